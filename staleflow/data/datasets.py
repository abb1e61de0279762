"""Prompt datasets: the synthetic task and local JSONL / Parquet files, tokenised once.

A :class:`PromptDataset` keeps every prompt's ids in one flat int32 array; indexing it
returns a :class:`Sample` whose ``prompt_ids`` is a read-only view into that array.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from staleflow.data.layouts import DatasetError, Prompt, RecordLayout, detect_layout, extract
from staleflow.data.synthetic import ArithmeticConfig, ArithmeticTask
from staleflow.data.tokenizer import Tokenizer, TokenizerError
from staleflow.install import missing

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """One prompt with its ground truth (satisfies ``trajectory_server.SampleLike``)."""

    sample_id: int  # position in its dataset
    prompt_ids: np.ndarray  # 1-D int32, read-only
    answer: str


class PromptDataset(Sequence[Sample]):
    def __init__(self, name: str, prompts: Sequence[np.ndarray], answers: Sequence[str]) -> None:
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
        if any(len(p) == 0 for p in prompts):
            raise ValueError(f"{name}: a prompt tokenised to no ids")
        self.name = name
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        self._offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._ids = (
            np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts])
            if len(prompts)
            else np.empty(0, dtype=np.int32)
        )
        self._ids.flags.writeable = False
        self._answers = tuple(answers)

    def __len__(self) -> int:
        return len(self._answers)

    @overload
    def __getitem__(self, index: int) -> Sample: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Sample]: ...
    def __getitem__(self, index: int | slice) -> Sample | Sequence[Sample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for {self.name} ({n} samples)")
        i = index % n
        start, end = self._offsets[i], self._offsets[i + 1]
        return Sample(i, self._ids[start:end], self._answers[i])

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.diff(self._offsets)

    def __repr__(self) -> str:
        return f"PromptDataset({self.name!r}, {len(self)} samples)"


def _encode(tokenizer: Tokenizer, prompt: Prompt) -> np.ndarray:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    return tokenizer.encode_chat(prompt)


def _from_rows(
    path: Path,
    rows: Iterator[tuple[int, object]],
    tokenizer: Tokenizer,
    layout: RecordLayout | None,
) -> PromptDataset:
    prompts: list[np.ndarray] = []
    answers: list[str] = []
    for row_number, row in rows:
        if layout is None:
            layout = detect_layout(row, path)
            logger.debug("%s: detected the %s layout", path, layout.name)
        prompt, answer = extract(row, layout, path, row_number)
        try:
            ids = _encode(tokenizer, prompt)
        except TokenizerError as exc:
            raise DatasetError(path, row_number, layout.prompt_field, str(exc)) from None
        if len(ids) == 0:
            raise DatasetError(path, row_number, layout.prompt_field, "tokenises to no ids")
        prompts.append(ids)
        answers.append(answer)
    if not prompts:
        raise DatasetError(path, None, None, "has no rows")
    return PromptDataset(path.name, prompts, answers)


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # a blank line holds no row
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    path, line_number, None, f"is not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None


def load_jsonl(
    path: str | Path, tokenizer: Tokenizer, layout: RecordLayout | None = None
) -> PromptDataset:
    """One JSON object per line; rows are numbered by line. ``layout=None`` detects a
    built-in layout from the first row."""
    p = Path(path)
    try:
        return _from_rows(p, _jsonl_rows(p), tokenizer, layout)
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(p, None, None, f"cannot be read: {exc}") from None


def load_parquet(
    path: str | Path, tokenizer: Tokenizer, layout: RecordLayout | None = None
) -> PromptDataset:
    """A Parquet file (through pyarrow); rows are numbered from 1."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(missing("pyarrow (for Parquet datasets)", exc)) from exc
    p = Path(path)
    try:
        table = pq.read_table(p)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise DatasetError(p, None, None, f"cannot be read as Parquet: {exc}") from None
    rows = enumerate(table.to_pylist(), start=1)
    return _from_rows(p, rows, tokenizer, layout)


def load_dataset(
    path: str | Path, tokenizer: Tokenizer, layout: RecordLayout | None = None
) -> PromptDataset:
    """By suffix: ``.jsonl`` (or ``.json`` with one object per line) or ``.parquet``."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        return load_jsonl(p, tokenizer, layout)
    if p.suffix in (".parquet", ".pq"):
        return load_parquet(p, tokenizer, layout)
    raise DatasetError(p, None, None, "unknown format; use a .jsonl or .parquet file")


def synthetic_dataset(
    tokenizer: Tokenizer,
    config: ArithmeticConfig | None = None,
    size: int = 10_000,
    start: int = 0,
) -> PromptDataset:
    """Problems ``start .. start + size`` of the arithmetic task, prompts with a bos."""
    task = ArithmeticTask(config)
    problems = task.problems(size, start)
    prompts = [tokenizer.encode(p.prompt, add_bos=True) for p in problems]
    cfg = task.config
    name = f"arithmetic(ops={cfg.num_operands},digits={cfg.max_digits},seed={cfg.seed})"
    return PromptDataset(name, prompts, [p.answer for p in problems])
