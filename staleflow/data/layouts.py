"""Where the prompt and the ground truth live in a dataset row, and checking one row.

The common RL layouts come built in: GSM8K (``question``, and ``answer`` whose final
result follows ``####``) and DAPO-Math-17k (``prompt`` as a chat list or a string, and
``reward_model.ground_truth``). Field names are dotted paths into nested records.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

Prompt = str | list[dict[str, str]]  # plain text, or chat messages {role, content}
_MISSING = object()
MISSING = _MISSING  # what get_field gives for a field the row lacks


class DatasetError(ValueError):
    """A dataset file or row that cannot be used. Names the file, row and field."""

    def __init__(self, path: str | Path, row: int | None, field: str | None, problem: str):
        self.path, self.row, self.field = str(path), row, field
        where = [self.path]
        if row is not None:
            where.append(f"row {row}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(f"{', '.join(where)}: {problem}")

    def __reduce__(self) -> tuple[object, ...]:  # picklable across processes
        return (_rebuild, (self.path, self.row, self.field, str(self)))


def _rebuild(path: str, row: int | None, field: str | None, message: str) -> DatasetError:
    err = DatasetError(path, row, field, "")
    err.args = (message,)
    return err


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """prompt_field, answer_field: dotted paths (``a.b`` reads ``row["a"]["b"]``; a key
    that itself contains the dot is tried first).
    answer_marker: when set, the ground truth is the text after the last marker in the
    answer field (GSM8K's ``####``); a row without it is an error.
    """

    prompt_field: str
    answer_field: str
    answer_marker: str | None = None
    name: str = "custom"


GSM8K = RecordLayout("question", "answer", answer_marker="####", name="gsm8k")
DAPO_MATH = RecordLayout("prompt", "reward_model.ground_truth", name="dapo-math")
BUILTIN_LAYOUTS = (DAPO_MATH, GSM8K)


def get_field(row: Mapping[str, object], path: str) -> object:
    """The value at a dotted path, or ``_MISSING``."""
    if path in row:
        return row[path]
    node: object = row
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _MISSING
        node = node[key]
    return node


def detect_layout(row: object, path: str | Path) -> RecordLayout:
    """The built-in layout whose fields the (first) row has."""
    if isinstance(row, Mapping):
        for layout in BUILTIN_LAYOUTS:
            if all(
                get_field(row, f) is not _MISSING
                for f in (layout.prompt_field, layout.answer_field)
            ):
                return layout
        keys = ", ".join(map(str, row)) or "none"
    else:
        keys = f"none (the row is a {type(row).__name__})"
    known = "; ".join(
        f"{lay.name}: {lay.prompt_field} + {lay.answer_field}" for lay in BUILTIN_LAYOUTS
    )
    raise DatasetError(
        path,
        1,
        None,
        f"no built-in layout matches its keys ({keys}); known layouts are {known}. Pass "
        "layout=RecordLayout(prompt_field=..., answer_field=...) naming your fields",
    )


def _check_prompt(value: object, err: _Err) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise err("is empty")
        return value
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        messages = []
        for i, m in enumerate(value):
            if (
                not isinstance(m, Mapping)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise err(f"message {i} must be an object with string 'role' and 'content'")
            messages.append({"role": m["role"], "content": m["content"]})
        if not messages:
            raise err("is an empty chat")
        return messages
    raise err(f"must be a string or a list of chat messages, got {type(value).__name__}")


def _check_answer(value: object, marker: str | None, err: _Err) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise err(f"must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise err(f"is {value}")
    text = str(value)
    if marker is not None:
        if marker not in text:
            raise err(f"has no {marker!r} marker before the final answer")
        text = text.rsplit(marker, 1)[1]
    text = text.strip()
    if not text:
        raise err("is empty")
    return text


class _Err:
    """Builds a DatasetError for one (file, row, field)."""

    def __init__(self, path: str | Path, row: int, field: str) -> None:
        self.path, self.row, self.field = path, row, field

    def __call__(self, problem: str) -> DatasetError:
        return DatasetError(self.path, self.row, self.field, problem)


def extract(
    row: object, layout: RecordLayout, path: str | Path, row_number: int
) -> tuple[Prompt, str]:
    """The (prompt, ground truth) of one row; ``row_number`` is 1-based."""
    if not isinstance(row, Mapping):
        raise DatasetError(
            path, row_number, None, f"must be a JSON object, got {type(row).__name__}"
        )
    values = []
    for field in (layout.prompt_field, layout.answer_field):
        value = get_field(row, field)
        if value is _MISSING:
            keys = ", ".join(map(str, row)) or "none"
            raise DatasetError(
                path,
                row_number,
                field,
                f"missing (the row has keys: {keys}); fix the row, or name the right field "
                "in the RecordLayout",
            )
        values.append(value)
    prompt = _check_prompt(values[0], _Err(path, row_number, layout.prompt_field))
    answer = _check_answer(
        values[1], layout.answer_marker, _Err(path, row_number, layout.answer_field)
    )
    return prompt, answer
