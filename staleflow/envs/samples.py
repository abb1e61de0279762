"""An environment's problems from a dataset: one :class:`EnvSample` per row.

A row gives the sample's prompt text (``prompt_field``), its ground truth
(``answer_field``) and every field the environment reads from ``EnvSample.extra``,
which it names in its optional ``columns`` attribute (e.g. a game's starting position).
Those travel with the trajectory as JSON (``EnvSample.to_json``), so they must be plain
data. Nothing is tokenised here: the environment's ``start`` turns a sample into its
first messages, and the turn format turns those into ids (``formats.episode_dataset``).

Every problem is a :class:`~staleflow.data.layouts.DatasetError` naming the file, the
row and the field, and how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

from staleflow.data.layouts import MISSING, DatasetError, get_field
from staleflow.envs.base import EnvContractError, Environment, EnvSample, Plain, check_plain


def sample_columns(env: Environment) -> tuple[str, ...]:
    """The fields ``env`` reads from each sample's ``extra`` (its ``columns`` attribute;
    none when it has none)."""
    columns = getattr(env, "columns", ())
    if isinstance(columns, str) or not all(isinstance(c, str) and c for c in columns):
        raise EnvContractError(
            f"environment {env.name!r}: columns={columns!r}; declare the sample fields it "
            "reads as a tuple of names, e.g. columns = ('board',)"
        )
    return tuple(columns)


def env_samples(
    rows: Iterable[tuple[int, object]],
    source: str | Path,
    *,
    prompt_field: str,
    answer_field: str,
    columns: tuple[str, ...] = (),
) -> list[EnvSample]:
    """The samples of ``rows`` (``(row number, row)`` pairs, as the dataset readers give
    them); sample ids count from 0 in row order."""
    out = []
    for row_number, row in rows:
        if not isinstance(row, Mapping):
            raise DatasetError(
                source, row_number, None, f"must be an object, got {type(row).__name__}"
            )
        prompt = _field(row, prompt_field, source, row_number, "the prompt", _COLUMN_FIX)
        if not isinstance(prompt, str) or not prompt.strip():
            raise DatasetError(
                source,
                row_number,
                prompt_field,
                f"must be non-empty text, got {_shown(prompt)}: an environment builds the "
                "messages from the prompt text itself (its start())",
            )
        answer = _field(row, answer_field, source, row_number, "the ground truth", _COLUMN_FIX)
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise DatasetError(
                source,
                row_number,
                answer_field,
                f"must be text or a number, got {_shown(answer)}",
            )
        if isinstance(answer, float) and not math.isfinite(answer):
            raise DatasetError(source, row_number, answer_field, f"is {answer}")
        extra: dict[str, Plain] = {}
        for column in columns:
            value = _field(
                row, column, source, row_number, "one of the environment's columns", _EXTRA_FIX
            )
            try:
                check_plain(value, column)
            except EnvContractError as exc:
                raise DatasetError(source, row_number, column, str(exc)) from None
            extra[column] = value  # type: ignore[assignment]  # checked plain above
        out.append(EnvSample(len(out), prompt, str(answer).strip(), extra))
    if not out:
        raise DatasetError(source, None, None, "has no rows")
    return out


_COLUMN_FIX = (
    "add it to every row, or name the rows' own field with data.prompt_column and "
    "data.answer_column"
)
_EXTRA_FIX = "add it to every row: the environment reads it from each sample"


def _field(
    row: Mapping[str, object], name: str, source: str | Path, row_number: int, what: str, fix: str
) -> object:
    value = get_field(row, name)
    if value is MISSING:
        keys = ", ".join(map(str, row)) or "none"
        raise DatasetError(
            source,
            row_number,
            name,
            f"missing ({what}; the row has: {keys}): {fix}",
        )
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}"
