"""Writing the run folder of one launch (``staleflow.runfolder.reader`` reads it).

The folder is made only when the actors are about to start, and a launch that stops
before its first training step takes it away again: a failed start leaves no debris
next to the real runs. Only the files written here are removed, never anything else.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO

from staleflow.config import RunConfig, save_config
from staleflow.engines.factory import ENGINE_MODEL_DIR
from staleflow.runfolder.layout import TRACKING
from staleflow.runfolder.reader import AUDIT, CONFIG, METRICS, STATE
from staleflow.runfolder.step_record import StepRecord

__all__ = ["AUDIT", "RunOutput"]

logger = logging.getLogger(__name__)


class RunOutput:
    """``runs/<time>-<name>/``: ``config.yaml`` (the resolved configuration) and
    ``metrics.jsonl`` (one record per training step), opened by :meth:`create`."""

    def __init__(self, path: Path, made_parent: bool = False, resumed: bool = False) -> None:
        self.path = path
        self.records = 0
        self._made_parent = made_parent  # run_dir did not exist before this launch
        self._resumed = resumed  # an earlier launch made the folder: never remove it
        self._metrics: IO[str] | None = None

    @classmethod
    def create(cls, cfg: RunConfig) -> RunOutput:
        """A new, unique folder under ``cfg.run_dir`` with the resolved config in it."""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = cfg.name or f"eta{cfg.eta}"
        base = Path(cfg.run_dir).expanduser()
        made_parent = not base.exists()
        base.mkdir(parents=True, exist_ok=True)
        n = 1
        while True:
            path = base / (f"{stamp}-{name}" if n == 1 else f"{stamp}-{name}-{n}")
            try:
                path.mkdir()
            except FileExistsError:  # another launch in the same second
                n += 1
                continue
            break
        out = cls(path, made_parent)
        save_config(cfg.resolved(), path / CONFIG)  # auto choices made explicit
        out._metrics = (path / METRICS).open("a", encoding="utf-8")
        return out

    @classmethod
    def resume(
        cls, path: Path, cfg: RunConfig, records: Sequence[Mapping[str, float]], version: int
    ) -> RunOutput:
        """The folder of a run resumed from a checkpoint of ``records`` steps at
        ``version``: ``metrics.jsonl`` goes back to those records and ``audit.jsonl`` to
        the batches before ``version`` (the steps after the checkpoint are done again);
        ``config.yaml`` takes the configuration the run goes on with."""
        _rewrite(path / METRICS, [StepRecord.from_flat(r).to_json() for r in records])
        audit = path / AUDIT
        if audit.is_file():
            with audit.open(encoding="utf-8") as f:
                kept = [line.rstrip("\n") for line in f if json.loads(line)["version"] < version]
            _rewrite(audit, kept)
        save_config(cfg.resolved(), path / CONFIG)
        out = cls(path, resumed=True)
        out.records = len(records)
        out._metrics = (path / METRICS).open("a", encoding="utf-8")
        return out

    @property
    def name(self) -> str:
        return self.path.name

    def record(self, rec: StepRecord) -> None:
        assert self._metrics is not None, "record() before create()"
        self._metrics.write(rec.to_json() + "\n")
        self._metrics.flush()
        self.records += 1

    def close(self, *, failed: bool) -> None:
        """Close the metrics file; a failed launch without a single step leaves nothing."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if failed and self.records == 0 and not self._resumed:
            self.discard()

    def discard(self) -> None:
        for name in (CONFIG, METRICS, STATE):
            (self.path / name).unlink(missing_ok=True)
        # the built-in policy saved for vLLM / SGLang to load: ours, and large; an engine's
        # logs are kept (with the warning below), they say why the start failed
        shutil.rmtree(self.path / ENGINE_MODEL_DIR, ignore_errors=True)
        # the trackers' files of a launch that never trained: nothing worth keeping
        shutil.rmtree(self.path / TRACKING, ignore_errors=True)
        try:
            self.path.rmdir()
            if self._made_parent and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()
        except OSError as exc:  # something else was written there: keep it, say so
            logger.warning("left the run folder %s in place: %s", self.path, exc)


def _rewrite(path: Path, lines: Sequence[str]) -> None:
    """Replace ``path`` with ``lines`` atomically (a crash leaves the old file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
