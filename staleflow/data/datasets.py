"""Prompt datasets: the synthetic task and local JSONL / Parquet files, tokenised once
(Hugging Face ``datasets`` sources: :mod:`staleflow.data.hf_datasets`).

A :class:`PromptDataset` keeps every prompt's ids in one flat int32 array; indexing it
returns a :class:`Sample` whose ``prompt_ids`` is a read-only view into that array. How a
row's prompt becomes ids is a :class:`PromptFormat` (as written, or through the
tokenizer's chat template with an optional system prompt).
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


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """How a prompt becomes ids. By default as written: text with a bos, a chat list
    through the tokenizer's chat template (plain ``role: content`` lines when it has
    none). ``chat_template``: every prompt through the tokenizer's chat template (text as
    one user message), which it must have (:func:`check_chat_template`); an instruct
    model expects its own turn markers. ``system_prompt`` (with ``chat_template``): a
    system message put first, unless the row's chat already starts with one."""

    chat_template: bool = False
    system_prompt: str = ""

    def __post_init__(self) -> None:
        if self.system_prompt and not self.chat_template:
            raise ValueError(
                "a system prompt needs the chat template: set data.chat_template=true, or "
                "drop data.system_prompt"
            )

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The chat of ``prompt``, system message first when one is set."""
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt and not (chat and chat[0]["role"] == "system"):
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat


AS_WRITTEN = PromptFormat()


def chat_template_of(tokenizer: Tokenizer) -> str | None:
    """The tokenizer's chat template (Jinja source), None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else None


def check_chat_template(tokenizer: Tokenizer, fmt: PromptFormat, source: str) -> None:
    """Refuse ``fmt.chat_template`` with a tokenizer that has no template; ``source`` names
    where the tokenizer came from."""
    if fmt.chat_template and chat_template_of(tokenizer) is None:
        raise TokenizerError(
            f"data.chat_template=true but the tokenizer of {source} has no chat template: "
            "add one ('chat_template' in its tokenizer_config.json, or a chat_template.jinja "
            "file next to it), or set data.chat_template=false to tokenize prompts as written"
        )


def _encode(tokenizer: Tokenizer, prompt: Prompt, fmt: PromptFormat) -> np.ndarray:
    if fmt.chat_template:
        return tokenizer.encode_chat(fmt.messages(prompt))
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    return tokenizer.encode_chat(prompt)


def from_rows(
    path: Path,
    rows: Iterator[tuple[int, object]],
    tokenizer: Tokenizer,
    layout: RecordLayout | None,
    fmt: PromptFormat = AS_WRITTEN,
) -> PromptDataset:
    """The dataset of ``(row number, row)`` pairs; ``layout=None`` detects a built-in
    layout from the first row."""
    prompts: list[np.ndarray] = []
    answers: list[str] = []
    for row_number, row in rows:
        if layout is None:
            layout = detect_layout(row, path)
            logger.debug("%s: detected the %s layout", path, layout.name)
        prompt, answer = extract(row, layout, path, row_number)
        try:
            ids = _encode(tokenizer, prompt, fmt)
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
    path: str | Path,
    tokenizer: Tokenizer,
    layout: RecordLayout | None = None,
    fmt: PromptFormat = AS_WRITTEN,
) -> PromptDataset:
    """One JSON object per line; rows are numbered by line. ``layout=None`` detects a
    built-in layout from the first row."""
    p = Path(path)
    try:
        return from_rows(p, _jsonl_rows(p), tokenizer, layout, fmt)
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(p, None, None, f"cannot be read: {exc}") from None


def load_parquet(
    path: str | Path,
    tokenizer: Tokenizer,
    layout: RecordLayout | None = None,
    fmt: PromptFormat = AS_WRITTEN,
) -> PromptDataset:
    """A Parquet file (through pyarrow); rows are numbered from 1."""
    p = Path(path)
    return from_rows(p, parquet_rows(p), tokenizer, layout, fmt)


def parquet_rows(path: Path) -> Iterator[tuple[int, object]]:
    """The rows of a Parquet file as ``(row number from 1, dict)``."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(missing("pyarrow (for Parquet datasets)", exc)) from exc
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise DatasetError(path, None, None, f"cannot be read as Parquet: {exc}") from None
    return enumerate(table.to_pylist(), start=1)


def file_rows(path: str | Path) -> Iterator[tuple[int, object]]:
    """The rows of a ``.jsonl`` (or ``.json``, one object per line) or ``.parquet`` file,
    by suffix, as ``(row number, row)``: JSONL rows are numbered by line, Parquet rows
    from 1. Read lazily; errors are :class:`DatasetError`."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        return _readable(p, _jsonl_rows(p))
    if p.suffix in (".parquet", ".pq"):
        return parquet_rows(p)
    raise DatasetError(p, None, None, "unknown format; use a .jsonl or .parquet file")


def _readable(path: Path, rows: Iterator[tuple[int, object]]) -> Iterator[tuple[int, object]]:
    try:
        yield from rows
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(path, None, None, f"cannot be read: {exc}") from None


def load_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    layout: RecordLayout | None = None,
    fmt: PromptFormat = AS_WRITTEN,
) -> PromptDataset:
    """By suffix: ``.jsonl`` (or ``.json`` with one object per line) or ``.parquet``."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        return load_jsonl(p, tokenizer, layout, fmt)
    if p.suffix in (".parquet", ".pq"):
        return load_parquet(p, tokenizer, layout, fmt)
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
