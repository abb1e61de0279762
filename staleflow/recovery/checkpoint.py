"""Run checkpoints: the durable state of a run, written atomically in a run folder.

Layout (``RUN_DIR/checkpoints/``)::

    step-00000012/            one checkpoint, named by the training steps done
        MANIFEST.json         format, step, version, protocol, size and sha256 of each file
        run.msgpack           steps, version, PS version, metrics so far
        staleness.msgpack     StalenessManager.export_state()
        trajectories.msgpack  TrajectoryServer.export_state() (with the sampler position)
        trainer/              written by the trainer itself: weights, optimizer, RNG, version
    .tmp-step-00000014-...    a checkpoint being written (ignored by readers)

Writing: every file goes into a temporary folder and is fsynced, the manifest last; the
folder is fsynced and renamed into place, then the parent is fsynced. A rename is atomic,
so a crash at any point leaves every earlier checkpoint as it was, and a reader never sees
half a checkpoint. Older checkpoints beyond ``keep`` are removed only after the new one is
in place. Reading checks the manifest (format, sizes, checksums) and the protocol settings
before anything is decoded, and never writes.

Plain data only: msgpack with numpy arrays as raw bytes (``trajectory_server.wire``),
JSON for the manifest. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from staleflow.recovery.errors import (
    CheckpointError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    NotACheckpoint,
    ProtocolMismatch,
)
from staleness.checkpoint import PROTOCOL_KEYS, config_dict
from staleness.types import StalenessConfig
from trajectory_server.errors import WireError
from trajectory_server.wire import pack_plain, unpack_plain

logger = logging.getLogger(__name__)

FORMAT = 1
KIND = "staleflow-run-checkpoint"
CHECKPOINTS = "checkpoints"
MANIFEST = "MANIFEST.json"
TRAINER = "trainer"
MEGATRON_DIR = "megatron"  # the Megatron pool's distributed checkpoint, inside TRAINER
_RUN, _STALENESS, _TRAJECTORIES = "run.msgpack", "staleness.msgpack", "trajectories.msgpack"
STALENESS_FILE = _STALENESS  # the staleness manager's exported state, in each checkpoint
_NAME = re.compile(r"^step-(\d{8})(?:-(\d+))?$")
_CHUNK = 1 << 20

Metrics = Sequence[Mapping[str, float]]


@dataclass(frozen=True)
class RunState:
    """What the run saves besides the trainer's own files, taken at a consistent cut:
    after training step ``steps`` and before the next Consume, so the staleness manager's
    version is the trainer's ``version``. Export the manager first, then the TS (see
    ``staleflow.recovery.restore.reconcile``)."""

    steps: int  # training steps done
    version: int  # the trainer's (and the staleness manager's) version
    ps_version: int  # the newest version the PS holds
    staleness: Mapping[str, Any]  # StalenessManager.export_state()
    trajectories: Mapping[str, Any]  # TrajectoryServer.export_state()
    metrics: Metrics = ()  # one record per step so far

    @property
    def sampler(self) -> Mapping[str, Any] | None:
        """The prompt sampler's position, saved by the TS with its own state."""
        return self.trajectories.get("source")


@dataclass(frozen=True)
class Checkpoint(RunState):
    """A checkpoint read back and verified."""

    path: Path = field(default=Path())
    protocol: Mapping[str, Any] = field(default_factory=dict)

    @property
    def trainer_dir(self) -> Path | None:
        """Where the trainer wrote its part, for ``trainer.load_checkpoint``."""
        p = self.path / TRAINER
        return p if p.is_dir() else None

    def check_protocol(self, config: StalenessConfig) -> None:
        """Refuse a run whose protocol settings differ (``ProtocolMismatch`` names the key)."""
        check_protocol(self.protocol, config)


def check_protocol(saved: Mapping[str, Any], config: StalenessConfig) -> None:
    given = config_dict(config)
    for key in PROTOCOL_KEYS:
        if saved.get(key) != given[key]:
            raise ProtocolMismatch(key, saved.get(key), given[key])


# -- writing ----------------------------------------------------------------------------


def write_checkpoint(
    run_dir: str | Path,
    state: RunState,
    *,
    trainer: Callable[[Path], None] | None = None,
    keep: int = 2,
) -> Path:
    """Write ``state`` (and the trainer's part, by calling ``trainer(folder)``, which must
    create ``folder``) as a new checkpoint of ``run_dir``; returns its folder.

    ``keep``: complete checkpoints to keep, the new one included. On any failure the
    temporary folder is removed and the exception propagates; earlier checkpoints are
    untouched.
    """
    if keep < 1:
        raise ValueError(f"keep={keep}; keep at least the checkpoint just written")
    _check_cut(state)
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = _free_name(root, state.steps)
    tmp = root / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        run = {
            "steps": state.steps,
            "version": state.version,
            "ps_version": state.ps_version,
            "metrics": [dict(r) for r in state.metrics],
        }
        for file, data in (
            (_RUN, run),
            (_STALENESS, state.staleness),
            (_TRAJECTORIES, state.trajectories),
        ):
            _write_file(tmp / file, pack_plain(data))
        if trainer is not None:
            trainer(tmp / TRAINER)
        manifest = {
            "kind": KIND,
            "format": FORMAT,
            "steps": state.steps,
            "version": state.version,
            "protocol": state.staleness["config"],
            "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "files": {rel: _describe(tmp / rel) for rel in _files(tmp)},
        }
        _write_file(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        _fsync_tree(tmp)
        os.rename(tmp, root / name)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    logger.info("checkpoint of step %d written to %s", state.steps, root / name)
    return root / name


def _check_cut(state: RunState) -> None:
    saved = state.staleness.get("version") if isinstance(state.staleness, Mapping) else None
    if saved != state.version:
        raise CheckpointError(
            f"the staleness manager is at version {saved!r} but the trainer at {state.version}: "
            "not a consistent cut; checkpoint after a training step and before the next Consume"
        )
    if state.ps_version > state.version or min(state.steps, state.ps_version) < 0:
        raise CheckpointError(
            f"ps_version={state.ps_version}, steps={state.steps}: the PS cannot be ahead of "
            f"the trainer's version {state.version}, and neither can be negative"
        )


def _free_name(root: Path, steps: int) -> str:
    name, k = f"step-{steps:08d}", 0
    while (root / name).exists():  # a resumed run checkpointing the same step again
        k += 1
        name = f"step-{steps:08d}-{k}"
    return name


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _describe(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _fsync_tree(folder: Path) -> None:
    """The trainer's files too: whoever wrote them, they are on disk before the rename."""
    for p in sorted(folder.rglob("*"), reverse=True):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif p.is_dir():
            _fsync_dir(p)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for debris in root.glob(".tmp-*"):  # left by writers that crashed
        if f"-{os.getpid()}-" not in debris.name:
            shutil.rmtree(debris, ignore_errors=True)


# -- reading ----------------------------------------------------------------------------


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (by steps, then by write)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            found.append(((int(m.group(1)), int(m.group(2) or 0)), p))
    return [p for _, p in sorted(found)]


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: a checkpoint itself, or the newest one of a
    run folder (or of its ``checkpoints/``)."""
    p = Path(path)
    if p.is_dir() and ((p / MANIFEST).is_file() or _NAME.match(p.name)):
        return p
    run_dir = p.parent if p.name == CHECKPOINTS else p
    found = list_checkpoints(run_dir)
    if not found:
        what = "no such folder" if not p.exists() else f"no complete checkpoint in {CHECKPOINTS}/"
        raise NotACheckpoint(
            f"{p}: {what}; --resume takes a run folder that `staleflow launch` checkpointed "
            "(see checkpoint_every), or one of its checkpoints/step-* folders"
        )
    return found[-1]


def read_checkpoint(path: str | Path, *, protocol: StalenessConfig | None = None) -> Checkpoint:
    """Read and verify a checkpoint (``path`` as for :func:`find_checkpoint`).

    Checks, in order, and before decoding anything: the manifest, the format, the protocol
    settings against ``protocol`` (the run's), every file's size and checksum. Raises
    ``NotACheckpoint``, ``CorruptCheckpoint``, ``IncompatibleCheckpoint`` or
    ``ProtocolMismatch``; writes nothing.
    """
    folder = find_checkpoint(path)
    manifest = read_manifest(folder)
    saved_protocol = manifest["protocol"]
    if protocol is not None:
        check_protocol(saved_protocol, protocol)
    expected = manifest["files"]
    present = set(_files(folder)) - {MANIFEST}
    missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or extra:
        raise CorruptCheckpoint(
            f"{folder}: files missing {missing} or not in the manifest {extra}; the checkpoint "
            "was changed after it was written: resume from an earlier one"
        )
    for rel, want in expected.items():
        if _describe(folder / rel) != want:
            raise CorruptCheckpoint(
                f"{folder / rel}: size or checksum differs from the manifest; the file was "
                "truncated or altered: resume from an earlier checkpoint"
            )
    run, staleness, trajectories = (_decode(folder / f) for f in (_RUN, _STALENESS, _TRAJECTORIES))
    if not isinstance(staleness, dict) or staleness.get("config") != saved_protocol:
        raise CorruptCheckpoint(
            f"{folder}: the manifest's protocol {saved_protocol} is not the staleness "
            "state's; the manifest was edited: resume from an earlier checkpoint"
        )
    try:
        return Checkpoint(
            steps=int(run["steps"]),
            version=int(run["version"]),
            ps_version=int(run["ps_version"]),
            staleness=staleness,
            trajectories=trajectories,
            metrics=[{str(k): float(v) for k, v in r.items()} for r in run["metrics"]],
            path=folder,
            protocol=saved_protocol,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{folder / _RUN}: missing or bad field: {exc}") from None


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as ``staleflow status`` lists it (from its manifest only)."""

    path: Path
    steps: int | None
    version: int | None
    written_at: str
    problem: str = ""  # why it cannot be resumed from ("" when its manifest is sound)


def describe_checkpoints(run_dir: str | Path) -> list[CheckpointInfo]:
    """Where a run can resume from, oldest first; cheap (manifests only, no checksums:
    ``--resume`` verifies those)."""
    out = []
    for folder in list_checkpoints(run_dir):
        try:
            m = read_manifest(folder)
        except CheckpointError as exc:
            out.append(CheckpointInfo(folder, None, None, "", str(exc)))
            continue
        out.append(
            CheckpointInfo(folder, m.get("steps"), m.get("version"), m.get("written_at", ""))
        )
    return out


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder (steps, version, protocol, written_at, files),
    checked for shape and format only: cheap enough for ``staleflow status``."""
    folder = Path(folder)
    file = folder / MANIFEST
    if not file.is_file():
        raise CorruptCheckpoint(
            f"{folder}: no {MANIFEST}; a complete checkpoint always has one (was the folder "
            "copied in part?): resume from an earlier checkpoint"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{file}: unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        raise CorruptCheckpoint(f"{file}: not a StaleFlow run checkpoint manifest")
    fmt = manifest.get("format")
    if fmt != FORMAT:
        newer = isinstance(fmt, int) and fmt > FORMAT
        raise IncompatibleCheckpoint(
            f"{file}: checkpoint format {fmt!r}, this StaleFlow reads format {FORMAT}"
            + ("; it was written by a newer StaleFlow: upgrade to resume it" if newer else "")
        )
    files, protocol = manifest.get("files"), manifest.get("protocol")
    if not isinstance(files, dict) or not isinstance(protocol, dict):
        raise CorruptCheckpoint(f"{file}: 'files' and 'protocol' must be objects")
    return manifest


def _decode(file: Path) -> Any:
    try:
        return unpack_plain(file.read_bytes())
    except WireError as exc:
        raise CorruptCheckpoint(f"{file}: {exc}") from None
