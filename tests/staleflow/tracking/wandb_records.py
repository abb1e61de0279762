"""Reading an offline W&B run back: the records of its ``run-<id>.wandb`` file.

wandb (0.2x+) keeps its reader in its Go core and has no Python one; the file is
LevelDB's log format (32 KiB blocks of records, each with a 7-byte header: CRC32, length,
kind; a record longer than a block's rest is split into first / middle / last parts)
behind a 7-byte file header (``:W&B``, a magic number, a version). Each whole record is
a ``wandb_internal_pb2.Record``: wandb's own protocol buffer, decoded by wandb's own class.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def run_file(folder: Path) -> Path:
    """The one ``.wandb`` file of the offline runs under ``folder``."""
    (path,) = folder.glob("**/offline-run-*/run-*.wandb")
    return path


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B", f"{path} is not a W&B run file"
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:  # zeros to the end of the block
            pos = (pos // _BLOCK + 1) * _BLOCK
            continue
        pos += _HEADER
        parts += data[pos : pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> list[dict[str, Any]]:
    """Each logged step's values (``_step`` is the step), in order."""
    out = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            out.append({_key(i): json.loads(i.value_json) for i in r.history.item})
    return out


def config(path: Path) -> dict[str, Any]:
    """The run's config: the run record's, then each config update."""
    out: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        items = (
            r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        )
        out.update({_key(i): json.loads(i.value_json) for i in items})
    return out


def summary(path: Path) -> dict[str, Any]:
    """The summary keys set explicitly (wandb's own ``_``-prefixed keys left out)."""
    out: dict[str, Any] = {}
    for r in records(path):
        if r.WhichOneof("record_type") == "summary":
            for i in r.summary.update:
                if i.key and not i.key.startswith("_"):
                    out[i.key] = json.loads(i.value_json)
    return out


def run_record(path: Path) -> Any:
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
