"""Tool calls in the Hermes / Qwen format, parsed tolerantly, refused clearly.

A model turn calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` (the format Qwen2.5 and Hermes chat templates teach, and that vLLM's and
SGLang's ``hermes`` / ``qwen25`` parsers read). The parser accepts what a model plausibly
writes around that: whitespace and newlines inside the tags, text before the call, a
missing closing tag at the very end of the turn (the turn stopped right after the JSON),
``arguments`` as a JSON object or as a JSON string holding one (the OpenAI wire form).
Anything else is a :class:`ToolCallError` whose message says what was wrong, for the
trajectory's record; it never raises anything else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_MAX_CALL_CHARS = 10_000  # a call longer than this is junk, not a call


class ToolCallError(ValueError):
    """A turn's tool call could not be read; the message says why."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


def has_tool_call(text: str) -> bool:
    """The turn tries to call a tool (well formed or not)."""
    return OPEN in text


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The call as a model writes it, in compact JSON (what demonstrations teach)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, separators=(",", ":"))
    return f"{OPEN}{body}{CLOSE}"


def format_tool_response(content: str) -> str:
    """A tool's result as the model reads it (Qwen's chat template wraps it so)."""
    return f"{RESPONSE_OPEN}{content}{RESPONSE_CLOSE}"


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call of a turn, in order ([] when it calls none)."""
    calls: list[ToolCall] = []
    rest = text
    while OPEN in rest:
        _, _, after = rest.partition(OPEN)
        body, _, rest = after.partition(CLOSE)
        if OPEN in body:
            raise ToolCallError(
                f"call {len(calls) + 1} opens {OPEN} again before closing with {CLOSE}"
            )
        calls.append(_parse_one(body, len(calls) + 1))
    if CLOSE in rest:
        raise ToolCallError(f"{CLOSE} without a {OPEN} before it")
    return calls


def _parse_one(body: str, n: int) -> ToolCall:
    where = f"tool call {n}"
    body = body.strip()
    if not body:
        raise ToolCallError(f"{where} is empty: write a JSON object with name and arguments")
    if len(body) > _MAX_CALL_CHARS:
        raise ToolCallError(
            f"{where} is {len(body)} characters long; the limit is {_MAX_CALL_CHARS}"
        )
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(
            f"{where} is not valid JSON ({exc.msg} at character {exc.pos}): {body[:80]!r}"
        ) from None
    if not isinstance(obj, dict):
        raise ToolCallError(f"{where} is a JSON {type(obj).__name__}, not an object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(f'{where} has no "name" string: {body[:80]!r}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # the OpenAI wire form: a JSON string of the object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolCallError(
                f"{where} ({name}): arguments is a string that is not JSON ({exc.msg})"
            ) from None
    if not isinstance(arguments, dict):
        raise ToolCallError(
            f"{where} ({name}): arguments is a {type(arguments).__name__}, not an object"
        )
    return ToolCall(name, arguments)
