"""The audit trail of a run (``recovery.audit_log``): every trajectory the trainer
consumed, with its prompt's sample id, tokens, per-token versions, finish reason, reward
and (multi-turn) loss mask and episode record (turns, tool calls, errors), one JSON line
each in ``RUN_DIR/audit.jsonl``. It lets a check (the chaos tests, an operator) prove
that no trajectory was trained on twice across restarts, that a resumed partial
continued from its tokens, and that a resumed run trained what one run straight through
trains. A resumed run drops the lines of the steps it does again."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from staleflow.trainers.interface import BatchSource
from trajectory_server.types import TrainingBatch, TrainingGroup, TrainingTrajectory


class AuditedBatches:
    """A batch source that writes down what it hands out; ``version()`` is the version
    the batch trains (the trainer's, when it takes it)."""

    def __init__(self, source: BatchSource, path: str | Path, version: Callable[[], int]) -> None:
        self._source, self._path, self._version = source, Path(path), version
        self._read: dict[int, TrainingGroup] = {}

    def read_batch(
        self, group_ids: Iterable[int], select: Mapping[int, Sequence[int]] | None = None
    ) -> TrainingBatch:
        """A streamed group is written down when its batch is taken, not when read."""
        batch = self._source.read_batch(group_ids, select)
        self._read.update((g.group_id, g) for g in batch.groups)
        return batch

    def take_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
        read: Iterable[int] = (),
    ) -> TrainingBatch:
        read = tuple(read)
        batch = self._source.take_batch(group_ids, select, read)
        groups = [self._read[g] for g in read] + list(batch.groups)
        self._read.clear()
        version = self._version()
        lines = [json.dumps(_line(version, g, t)) for g in groups for t in g.trajectories]
        with self._path.open("a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return batch


def _line(version: int, g: TrainingGroup, t: TrainingTrajectory) -> dict[str, Any]:
    line = {
        "version": version,
        "group_id": g.group_id,
        "sample_id": int(g.sample_id),  # the prompt; with traj_id, the keys a resume must keep
        "traj_id": t.traj_id,
        "v_traj": t.v_traj,
        "tokens": t.tokens.tolist(),
        "versions": t.versions.tolist(),
        "finish_reason": t.finish_reason,
        "reward": float(t.reward),
    }
    if t.mask is not None and not t.mask.all():  # a multi-turn response: its loss mask
        line["mask"] = t.mask.astype(int).tolist()
    if "turns" in t.info:  # an episode's record (staleflow.runtime.workers.env_stage)
        line["info"] = dict(t.info)
    return line


def read_audit(path: str | Path) -> list[dict[str, Any]]:
    """Every line of an ``audit.jsonl``."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
