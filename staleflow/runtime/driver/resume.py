"""``staleflow launch --resume RUN_DIR``: where a run stopped, checked before anything is
created (``docs/recovery.md``).

:func:`check_resume` reads the run folder's configuration (with the user's overrides on
top) and its newest checkpoint, and refuses, naming the reason, a folder that is not a
run, a checkpoint that is corrupt or of another format, a configuration that changes the
protocol (η, batch and group size, redundancy), and a run that already reached its step
count. It only reads: a refused resume leaves the folder as it was.
:func:`restore_state` then rebuilds the staleness manager and the trajectory server in
the driver, makes them agree, and hands the launcher what its actors start from.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.config import ConfigError, load_config
from staleflow.data import PromptSampler
from staleflow.recovery import Checkpoint, CheckpointError, NotACheckpoint, read_checkpoint
from staleflow.recovery.checkpoint import MEGATRON_DIR
from staleflow.recovery.restore import restore_run
from staleflow.runfolder.reader import CONFIG
from staleflow.runtime.errors import LaunchError

if TYPE_CHECKING:
    from staleflow.config import RunConfig
    from staleflow.control.dynamic_sampling import SamplingConfig
    from staleflow.data import PromptDataset, PromptSampler
    from trajectory_server.types import TrajectoryServerConfig

logger = logging.getLogger(__name__)


class ResumeError(LaunchError):
    """A resume refused before anything started; the message says why and what to do."""


@dataclass(frozen=True)
class ResumePoint:
    """What the actors of a resumed run start from."""

    checkpoint: Checkpoint
    staleness: Mapping[str, Any]  # the restored, reconciled manager's state
    trajectories: Mapping[str, Any]  # the restored, reconciled TS's state
    sampler: PromptSampler  # at the TS's saved position
    replayed: tuple[int, ...] = ()  # completions the manager had not applied

    @property
    def version(self) -> int:
        return self.checkpoint.version

    @property
    def steps(self) -> int:
        return self.checkpoint.steps

    @property
    def metrics(self) -> Sequence[Mapping[str, float]]:
        return self.checkpoint.metrics


def check_resume(
    run_dir: str | Path, overrides: Sequence[str] = ()
) -> tuple[RunConfig, Checkpoint]:
    """The run's configuration (``config.yaml`` with ``overrides``) and its newest
    checkpoint (or the checkpoint folder ``run_dir`` names), verified. Raises
    :class:`ResumeError`; writes nothing."""

    path = Path(run_dir).expanduser()
    folder = path.parents[1] if (path / "MANIFEST.json").is_file() else path
    if not (folder / CONFIG).is_file():
        raise ResumeError(
            f"{path} is not a run folder (no {CONFIG}): --resume takes a folder that "
            "`staleflow launch` wrote, e.g. runs/<time>-<name>"
        )
    try:
        cfg = load_config(str(folder / CONFIG), list(overrides))
    except (ConfigError, ValueError, OSError) as exc:
        raise ResumeError(f"cannot read the run's configuration {folder / CONFIG}: {exc}") from exc
    try:
        ck = read_checkpoint(path, protocol=cfg.staleness_config())
    except NotACheckpoint as exc:
        raise ResumeError(f"nothing to resume: {exc}") from exc
    except CheckpointError as exc:
        raise ResumeError(f"cannot resume {path}: {exc}") from exc
    if ck.trainer_dir is None:
        raise ResumeError(
            f"{ck.path} has no trainer/ part: it cannot restore the policy; resume from an "
            "earlier checkpoint (--resume RUN_DIR/checkpoints/step-...)"
        )
    _check_trainer_part(cfg.trainer.backend, ck)
    if ck.steps >= cfg.steps:
        raise ResumeError(
            f"the run already took its {cfg.steps} steps ({ck.steps} in {ck.path.name}): "
            f"resume with steps=N for N > {ck.steps} to train more"
        )
    return cfg, ck


def _check_trainer_part(backend: str, ck: Checkpoint) -> None:
    """The trainer part must be the one ``trainer.backend`` (``backend``) loads: the
    embedded trainer's files, or the Megatron pool's distributed checkpoint in
    ``trainer/megatron``."""
    assert ck.trainer_dir is not None
    megatron = (ck.trainer_dir / MEGATRON_DIR).is_dir()
    if backend == "megatron" and not megatron:
        raise ResumeError(
            f"{ck.path} was written by the embedded trainer (no trainer/{MEGATRON_DIR}/ "
            "distributed checkpoint): resume it with trainer.backend=embedded"
        )
    if backend != "megatron" and megatron:
        raise ResumeError(
            f"{ck.path} was written by the Megatron trainer pool (trainer/{MEGATRON_DIR}/): "
            f"trainer.backend={backend} cannot load it; resume with trainer.backend=megatron"
        )


def restore_state(
    trajectory_server: TrajectoryServerConfig,
    sampling: SamplingConfig | None,
    ck: Checkpoint,
    dataset: PromptDataset,
) -> ResumePoint:
    """The manager and the TS of ``ck``, restored and reconciled in this process under the
    run's ``trajectory_server`` section and dynamic ``sampling`` (the run plan's), with
    the prompt sampler at the TS's position. Refuses another dataset."""

    if ck.sampler is None:
        raise ResumeError(f"{ck.path}: the checkpoint has no prompt-sampler position")
    try:
        sampler = PromptSampler.from_state(dataset, ck.sampler)
    except ValueError as exc:
        raise ResumeError(f"cannot resume on these prompts: {exc}") from exc
    try:
        manager, ts, rec = restore_run(ck, trajectory_server, sampler, sampling)
    except (CheckpointError, ValueError) as exc:
        raise ResumeError(f"cannot resume {ck.path}: {exc}") from exc
    if rec.replayed:
        logger.info("resume: %d completions replayed", len(rec.replayed))
    trajectories = ts.export_state()  # the reconcile may have refilled: its position
    return ResumePoint(
        ck,
        manager.export_state(),
        trajectories,
        PromptSampler.from_state(dataset, trajectories["source"]),
        rec.replayed,
    )
