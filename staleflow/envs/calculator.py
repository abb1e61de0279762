"""The built-in agentic task: arithmetic with a calculator tool that takes its time.

The problems are those of the built-in arithmetic task (``staleflow.data.synthetic``) at a
level where a small model cannot reliably compute the answer itself but can learn to ask
the calculator: a model turn calls ``calculator`` with the expression, the tool answers
after a delay drawn from a heavy-tailed (Pareto) distribution, and the model's next turn
states the answer. The episode ends at a turn without a tool call; it scores 1 when that
turn's answer (the text after its last ``=``) is the ground truth.

Everything random is keyed by the trajectory's seed and the turn (:func:`keyed_uniform`),
so a step re-run after a failure or a resume waits as long and answers the same. A
malformed call, an unknown tool or an expression the calculator refuses is that
trajectory's error (``Step.error``, in the run's records); the tool answers ``error``
and the episode goes on, within its limits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from staleflow.data.synthetic import (
    ArithmeticConfig,
    ArithmeticTask,
    ExpressionError,
    evaluate,
    extract_answer,
    split_expression,
)
from staleflow.data.tokenizer import CharTokenizer, Tokenizer
from staleflow.envs.base import EnvSample, EnvState, Episode, ModelTurn, Step, keyed_uniform
from staleflow.envs.formats import TurnFormat, tool_tokenizer
from staleflow.envs.tool_calls import (
    ToolCall,
    ToolCallError,
    format_tool_call,
    has_tool_call,
    parse_tool_calls,
)

TOOL_NAME = "calculator"
ARGUMENT = "expression"
ERROR_RESULT = "error"  # what the model reads when its call failed; the reason is in the record
MAX_EXPRESSION_CHARS = 64  # 8 operands of 6 digits and their operators fit
CALCULATOR_TOOL: Mapping[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an integer expression of +, - and * (usual precedence).",
        "parameters": {
            "type": "object",
            "properties": {ARGUMENT: {"type": "string", "description": "e.g. 12+7*3"}},
            "required": [ARGUMENT],
        },
    },
}
SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Call the calculator tool with the expression, then "
    "answer with the number it returns."
)
DEFAULT_LEVEL = 3  # three operands with *: a tiny model needs the tool


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says why."""


def calculate(expression: str) -> str:
    """The value of an integer expression of ``+``, ``-`` and ``*`` as a string."""
    text = expression.replace(" ", "")
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(
            f"the expression has {len(text)} characters; the calculator takes at most "
            f"{MAX_EXPRESSION_CHARS}"
        )
    try:
        parts = split_expression(text)
    except ExpressionError as e:
        if e.char is None:
            raise CalculatorError(f"{expression!r} ends in an operator") from None
        raise CalculatorError(
            f"cannot read {expression!r} at {e.char!r}: use digits and + - *"
        ) from None
    return str(evaluate(parts))


def pareto_latency(u: float, scale_s: float, shape: float, cap_s: float) -> float:
    """A Pareto(``shape``) delay of minimum ``scale_s`` for the uniform draw ``u`` in
    (0, 1), capped at ``cap_s``: most calls take about ``scale_s``, a few take many times
    that (with ``shape`` 1.5 one call in 10 takes over 4.6 x ``scale_s``, one in 100 over
    21 x)."""
    if scale_s <= 0:
        return 0.0
    return min(cap_s, scale_s * u ** (-1.0 / shape))


@dataclass(frozen=True, slots=True)
class _Answer:
    result: str
    error: str


class CalculatorEnvironment:
    """See the module docstring. ``latency_scale_s`` 0 makes the tool answer at once."""

    name = "calculator"

    def __init__(
        self,
        *,
        latency_scale_s: float = 0.05,
        latency_shape: float = 1.5,
        latency_cap_s: float = 5.0,
    ) -> None:
        if not (math.isfinite(latency_scale_s) and latency_scale_s >= 0):
            raise ValueError(f"latency_scale_s={latency_scale_s}; use seconds >= 0 (0: no wait)")
        if not (math.isfinite(latency_shape) and latency_shape > 0):
            raise ValueError(f"latency_shape={latency_shape}; use a Pareto shape > 0, e.g. 1.5")
        if not (math.isfinite(latency_cap_s) and latency_cap_s >= latency_scale_s):
            raise ValueError(
                f"latency_cap_s={latency_cap_s}; use seconds >= latency_scale_s={latency_scale_s}"
            )
        self.latency_scale_s = latency_scale_s
        self.latency_shape = latency_shape
        self.latency_cap_s = latency_cap_s

    def start(self, sample: EnvSample, seed: int) -> Episode:
        messages = (
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": sample.prompt},
        )
        state: EnvState = {
            "answer": sample.answer,
            "seed": int(seed),
            "tool_calls": 0,
            "tool_errors": 0,
            "final": None,
        }
        return Episode(messages, (CALCULATOR_TOOL,), state)

    def step(self, state: EnvState, turn: ModelTurn) -> Step:
        seed = int(state["seed"])  # type: ignore[arg-type]
        if not has_tool_call(turn.text):
            final = extract_answer(turn.text)
            return Step({**state, "final": final}, done=True, info={"tool_calls": 0})
        try:
            calls = parse_tool_calls(turn.text)
        except ToolCallError as exc:
            answers = [_Answer(ERROR_RESULT, f"turn {turn.index}: malformed tool call: {exc}")]
        else:
            answers = [self._answer(call) for call in calls]
        latency = sum(
            pareto_latency(
                keyed_uniform(seed, "calculator", turn.index, i),
                self.latency_scale_s,
                self.latency_shape,
                self.latency_cap_s,
            )
            for i in range(len(answers))
        )
        errors = [a.error for a in answers if a.error]
        new_state: EnvState = {
            **state,
            "tool_calls": int(state["tool_calls"]) + len(answers),  # type: ignore[arg-type]
            "tool_errors": int(state["tool_errors"]) + len(errors),  # type: ignore[arg-type]
        }
        return Step(
            new_state,
            observation=" ".join(a.result for a in answers),
            latency_s=latency,
            error="; ".join(errors),
            info={
                "tool_calls": len(answers),
                "tool_errors": len(errors),
                "tool_latency_s": latency,
            },
        )

    def _answer(self, call: ToolCall) -> _Answer:
        if call.name != TOOL_NAME:
            return _Answer(ERROR_RESULT, f"unknown tool {call.name!r}; the tool is {TOOL_NAME!r}")
        expression = call.arguments.get(ARGUMENT)
        if not isinstance(expression, str):
            return _Answer(
                ERROR_RESULT,
                f"{TOOL_NAME} needs the string argument {ARGUMENT!r}, got {dict(call.arguments)!r}",
            )
        try:
            return _Answer(calculate(expression), "")
        except CalculatorError as exc:
            return _Answer(ERROR_RESULT, f"{TOOL_NAME}: {exc}")

    def score(self, state: EnvState) -> float:
        final = state.get("final")
        return 1.0 if isinstance(final, str) and final == state["answer"] else 0.0


def calculator_samples(
    config: ArithmeticConfig | None = None, size: int = 10_000, start: int = 0
) -> list[EnvSample]:
    """Samples ``start .. start + size`` of the task: the arithmetic problems of ``config``
    (level :data:`DEFAULT_LEVEL` by default), prompt ``"12+7*3="``, answer ``"33"``."""
    task = ArithmeticTask(config or ArithmeticConfig.level(DEFAULT_LEVEL))
    return [EnvSample(p.index, p.prompt, p.answer) for p in task.problems(size, start)]


def calculator_tokenizer() -> CharTokenizer:
    """The built-in model's tokenizer for this task: the arithmetic alphabet plus the
    tool-call markup (the arithmetic ids unchanged)."""
    return tool_tokenizer(TOOL_NAME, arguments=(ARGUMENT,))


@dataclass(frozen=True, slots=True, eq=False)
class Demonstration:
    """A solved episode for the supervised warm-up: ``response`` follows ``prompt``;
    ``mask`` is True on the model's tokens (trained), False on the observation's."""

    prompt: np.ndarray
    response: np.ndarray
    mask: np.ndarray


def demonstration(sample: EnvSample, fmt: TurnFormat, tokenizer: Tokenizer) -> Demonstration:
    """The tool-using solution of ``sample``: call the calculator with the expression,
    read its result, answer with it. The warm-up teaches the built-in model these, so
    that it calls the tool before RL starts."""
    expression = sample.prompt.strip().removesuffix("=")
    call = np.append(
        tokenizer.encode(format_tool_call(TOOL_NAME, {ARGUMENT: expression})), fmt.end_of_turn
    )
    observation = fmt.observation_ids(calculate(expression))
    answer = np.append(tokenizer.encode(sample.answer), fmt.end_of_turn)
    response = np.concatenate([call, observation, answer]).astype(np.int32)
    mask = np.concatenate(
        [np.ones(len(call), bool), np.zeros(len(observation), bool), np.ones(len(answer), bool)]
    )
    prompt = fmt.prompt_ids(CalculatorEnvironment(latency_scale_s=0).start(sample, seed=0))
    return Demonstration(prompt, response, mask)
