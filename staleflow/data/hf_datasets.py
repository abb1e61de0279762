"""Hugging Face ``datasets`` sources (``data.task=hf``), read locally, never from the Hub.

``data.path`` is either a folder written by ``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk`` (read with ``datasets.load_from_disk``), or one or more local
files (a glob is allowed: ``data/train-*.parquet``) in a format ``datasets.load_dataset``
reads by builder: Arrow, Parquet, JSON / JSON Lines or CSV, chosen by suffix. Columns are
checked before any row is tokenised: a prompt or answer column the dataset lacks is an
error that names the columns it has. The rows then go through the same checks and
tokenisation as a JSONL file (:func:`staleflow.data.datasets.from_rows`).
"""

from __future__ import annotations

import glob
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.data.datasets import AS_WRITTEN, PromptDataset, PromptFormat, from_rows
from staleflow.data.layouts import DatasetError, RecordLayout, detect_layout
from staleflow.data.tokenizer import Tokenizer
from staleflow.install import missing

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

# suffix -> the datasets builder that reads it
BUILDERS = {
    ".arrow": "arrow",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            missing("datasets (for data.task=hf)", exc, extra="datasets")
            + " (or pip install datasets)"
        ) from exc
    # the launch reports its own progress; datasets' bars would cut through its display
    datasets.disable_progress_bars()
    return datasets


def is_saved_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a folder ``save_to_disk`` wrote: a Dataset's state file, or a
    DatasetDict's list of splits (named by datasets itself)."""
    config = _datasets().config
    p = Path(path)
    saved = (config.DATASET_STATE_JSON_FILENAME, config.DATASETDICT_JSON_FILENAME)
    return p.is_dir() and any((p / name).is_file() for name in saved)


def data_files(path: str | Path) -> list[str]:
    """The files ``path`` names (itself, or what its glob matches), sorted; [] if none."""
    text = str(Path(path).expanduser())
    if glob.has_magic(text):
        return sorted(f for f in glob.glob(text) if Path(f).is_file())
    return [text] if Path(text).is_file() else []


def open_hf_dataset(path: str | Path, split: str = "train") -> Any:
    """The ``datasets.Dataset`` at ``path`` (the ``split`` of a saved DatasetDict, or of
    the files); :class:`DatasetError` says what is wrong and how to fix it."""
    datasets = _datasets()
    p = Path(path).expanduser()
    if p.is_dir():
        if not is_saved_dataset(p):
            raise DatasetError(
                p,
                None,
                None,
                "is a folder but not one save_to_disk wrote (no state.json or "
                "dataset_dict.json): point data.path at the saved folder, or at data files "
                f"({', '.join(sorted(set(BUILDERS)))}; a glob such as {p}/*.parquet is allowed)",
            )
        try:
            loaded = datasets.load_from_disk(str(p))
        except (OSError, ValueError) as exc:
            raise DatasetError(p, None, None, f"cannot be loaded: {exc}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DatasetError(
                    p,
                    None,
                    None,
                    f"has no split {split!r}; its splits are {', '.join(loaded)}: set "
                    "data.split to one of them",
                )
            return loaded[split]
        return loaded
    files = data_files(p)
    if not files:
        raise DatasetError(p, None, None, "no such file, folder or matching files")
    suffixes = {Path(f).suffix for f in files}
    builders = {BUILDERS.get(s) for s in suffixes}
    if None in builders or len(builders) != 1:
        raise DatasetError(
            p,
            None,
            None,
            f"holds files of suffixes {', '.join(sorted(suffixes))}: data.task=hf reads "
            f"files of one format, by suffix: {', '.join(sorted(BUILDERS))}",
        )
    (builder,) = builders
    try:
        # data_files of a local builder: nothing is fetched; split names the files' split
        return datasets.load_dataset(builder, data_files=files, split=split)
    except (OSError, ValueError) as exc:
        raise DatasetError(p, None, None, f"cannot be read as {builder}: {exc}") from None


def check_columns(ds: Dataset, layout: RecordLayout | None, path: str | Path) -> RecordLayout:
    """``layout``, or the built-in layout the first row matches, once the dataset is
    known to have its columns (a dotted field needs its first part as a column)."""
    columns = list(ds.column_names)
    if len(ds) == 0:
        raise DatasetError(path, None, None, "has no rows")
    if layout is None:
        return detect_layout(ds[0], path)
    for key, field in (("prompt", layout.prompt_field), ("answer", layout.answer_field)):
        if field not in columns and field.split(".", 1)[0] not in columns:
            raise DatasetError(
                path,
                None,
                field,
                f"no such column (the {key} column); the dataset's columns are "
                f"{', '.join(columns) or 'none'}: set data.{key}_column to one of them",
            )
    return layout


def load_hf_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    layout: RecordLayout | None = None,
    fmt: PromptFormat = AS_WRITTEN,
    split: str = "train",
) -> PromptDataset:
    """The prompts of a ``datasets`` source (see the module docstring); rows are numbered
    from 1."""
    ds = open_hf_dataset(path, split)
    layout = check_columns(ds, layout, path)
    logger.info("%s: %d rows (split %s), %s layout", path, len(ds), split, layout.name)
    return from_rows(Path(path), enumerate(ds, start=1), tokenizer, layout, fmt)
