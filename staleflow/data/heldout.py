"""The held-out set of a run (the ``eval`` section): a user's file or ``datasets`` source,
read by the loaders and rules that read the training prompts, or the built-in arithmetic
task's own held-out problems.

The format of ``eval.path`` follows from its name: ``.jsonl`` / ``.json`` and ``.parquet``
/ ``.pq`` files as ``data.task=jsonl`` / ``parquet`` read them, anything else (a
``save_to_disk`` folder, ``.arrow`` / ``.csv`` files, a glob) as ``data.task=hf`` does.
:func:`check_heldout_source` looks at the columns without a tokenizer, so that a path or a
column that is not there is refused before a cluster is joined or a model loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from staleflow.data.datasets import (
    AS_WRITTEN,
    PromptDataset,
    PromptFormat,
    load_dataset,
    synthetic_dataset,
)
from staleflow.data.hf_datasets import check_columns, data_files, load_hf_dataset, open_hf_dataset
from staleflow.data.layouts import DatasetError, RecordLayout, detect_layout
from staleflow.data.synthetic import ArithmeticConfig
from staleflow.data.tokenizer import Tokenizer

# Offset of the built-in task's held-out problem stream from the run's seed; the warm-up
# uses seed and the run's prompts seed + 1 (launch.build_dataset), so this stream shares
# neither prefix.
EVAL_SEED_OFFSET = 1_000_003

FILE_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


def heldout_format(path: str | Path) -> str:
    """``jsonl``, ``parquet`` or ``hf``: how ``path`` is read (see the module docstring)."""
    return FILE_SUFFIXES.get(Path(path).suffix, "hf")


def builtin_heldout(
    tokenizer: Tokenizer, difficulty: int, seed: int, problems: int
) -> PromptDataset:
    """The first ``problems`` held-out problems of the built-in task at ``difficulty``
    (the stream the start and end scores sample, ``staleflow.runtime.driver.evaluation``)."""
    task = ArithmeticConfig.level(difficulty, seed=seed + EVAL_SEED_OFFSET)
    return synthetic_dataset(tokenizer, task, size=problems)


def load_heldout(
    path: str | Path,
    tokenizer: Tokenizer,
    layout: RecordLayout | None = None,
    fmt: PromptFormat = AS_WRITTEN,
    split: str = "test",
    problems: int | None = None,
) -> PromptDataset:
    """The first ``problems`` rows (all with None) of the held-out set at ``path``.
    Raises :class:`DatasetError` naming the file, row and field."""
    if heldout_format(path) == "hf":
        dataset = load_hf_dataset(path, tokenizer, layout, fmt, split)
    else:
        dataset = load_dataset(path, tokenizer, layout, fmt)
    if problems is None or problems >= len(dataset):
        return dataset
    kept = dataset[:problems]
    return PromptDataset(dataset.name, [s.prompt_ids for s in kept], [s.answer for s in kept])


def check_heldout_source(path: str | Path, layout: RecordLayout | None, split: str) -> None:
    """Refuse a held-out set that is not there or lacks the prompt or answer column
    (:class:`DatasetError`, naming the columns it has), reading one row at most."""
    kind = heldout_format(path)
    p = Path(path).expanduser()
    if kind == "hf":
        if not p.is_dir() and not data_files(p):
            raise DatasetError(p, None, None, "no such file, folder or matching files")
        check_columns(open_hf_dataset(p, split), layout, p)
        return
    if not p.is_file():
        raise DatasetError(p, None, None, "no such file")
    columns, first = _first_row(p, kind)
    if first is None:
        raise DatasetError(p, None, None, "has no rows")
    if layout is None:
        detect_layout(first, p)
        return
    for key, name in (("prompt", layout.prompt_field), ("answer", layout.answer_field)):
        if name not in columns and name.split(".", 1)[0] not in columns:
            found = ", ".join(columns) or "none"
            raise DatasetError(
                p,
                None,
                name,
                f"no such column (the {key} column); the file's columns are {found}: set "
                f"data.{key}_column to one of them",
            )


def _first_row(path: Path, kind: str) -> tuple[list[str], dict[str, object] | None]:
    """The column names and first row of a JSONL or Parquet file."""
    if kind == "parquet":
        import pyarrow.parquet as pq  # with the Parquet loader's own dependency

        try:
            table = pq.ParquetFile(path)
            names = list(table.schema_arrow.names)
            batch = next(table.iter_batches(batch_size=1), None)
        except (OSError, ValueError) as exc:
            raise DatasetError(path, None, None, f"cannot be read as Parquet: {exc}") from None
        rows = batch.to_pylist() if batch is not None else []
        return names, rows[0] if rows else None
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(
                        path, number, None, f"is not valid JSON ({exc.msg} at column {exc.colno})"
                    ) from None
                if not isinstance(row, dict):
                    raise DatasetError(
                        path, number, None, f"must be a JSON object, got {type(row).__name__}"
                    )
                return list(row), row
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(path, None, None, f"cannot be read: {exc}") from None
    return [], None
