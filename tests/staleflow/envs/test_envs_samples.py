"""An environment's problems from dataset rows: prompt, ground truth and the fields the
environment names in its columns; what cannot be used is refused by file, row and field."""

from __future__ import annotations

import pytest

from staleflow.data.layouts import DatasetError
from staleflow.envs import EnvContractError, EnvSample
from staleflow.envs.samples import env_samples, sample_columns


def _read(rows, columns=("board",)):
    return env_samples(
        enumerate(rows, start=1),
        "p.jsonl",
        prompt_field="question",
        answer_field="solution.value",
        columns=columns,
    )


def test_rows_become_samples_with_their_columns_as_extra() -> None:
    rows = [
        {"question": "solve a", "solution": {"value": 3}, "board": [[1, 2], [3, None]], "x": 1},
        {"question": "solve b", "solution": {"value": " win "}, "board": {"size": 2}},
    ]
    first, second = _read(rows)
    assert first == EnvSample(0, "solve a", "3", {"board": [[1, 2], [3, None]]})
    assert second.sample_id == 1 and second.answer == "win"
    assert EnvSample.from_json(first.to_json()) == first  # what the TS carries


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ({"solution": {"value": 1}, "board": 1}, "question", "missing.*data.prompt_column"),
        ({"question": "q", "board": 1}, "solution.value", "missing"),
        ({"question": "q", "solution": {"value": 1}}, "board", "missing.*environment"),
        (
            {"question": [{"role": "user", "content": "q"}], "solution": {"value": 1}, "board": 1},
            "question",
            "non-empty text",
        ),
        ({"question": "q", "solution": {"value": True}, "board": 1}, "solution.value", "number"),
        ({"question": "q", "solution": {"value": 1}, "board": float("nan")}, "board", "finite"),
    ],
)
def test_a_row_that_cannot_be_used_is_refused_by_row_and_field(row, field, problem) -> None:
    good = {"question": "q", "solution": {"value": 1}, "board": 1}
    with pytest.raises(DatasetError, match=problem) as caught:
        _read([good, row])
    assert (caught.value.row, caught.value.field) == (2, field)
    assert str(caught.value).startswith("p.jsonl, row 2")


def test_no_rows_and_malformed_columns_are_refused() -> None:
    with pytest.raises(DatasetError, match="no rows"):
        _read([])

    class Env:
        name = "e"
        columns = "board"  # a string, not a tuple of names

    with pytest.raises(EnvContractError, match="tuple of names"):
        sample_columns(Env())  # type: ignore[arg-type]
    Env.columns = ("board", "size")  # type: ignore[assignment]
    assert sample_columns(Env()) == ("board", "size")  # type: ignore[arg-type]
