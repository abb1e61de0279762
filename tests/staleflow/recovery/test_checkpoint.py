"""The run checkpoint format: round trip, atomic writes, and what a load refuses."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from staleflow.recovery import (
    CheckpointError,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    NotACheckpoint,
    ProtocolMismatch,
    find_checkpoint,
    list_checkpoints,
    read_checkpoint,
    read_manifest,
    write_checkpoint,
)
from staleflow.recovery import checkpoint as ckpt_module
from staleness import StalenessConfig
from tests.staleflow.recovery.runs import busy_run
from trajectory_server.wire import pack_plain

METRICS = [{"step": 0.0, "train/loss": 0.5, "staleness/consume/mean_gap": 1.0}]


def fake_trainer(folder: Path) -> None:
    """Stands in for ``Trainer.save_checkpoint``: weights, optimizer state, RNG, version."""
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(np.arange(1000, dtype=np.float32).tobytes())
    (folder / "optimizer.pt").write_bytes(b"adam" * 100)
    (folder / "state.json").write_text(json.dumps({"version": 1, "rng": [1, 2, 3]}))


def tree(folder: Path) -> dict[str, tuple[str, int]]:
    """Every path under ``folder``; files with their content hash and modification time."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out[p.relative_to(folder).as_posix()] = (
                hashlib.sha256(p.read_bytes()).hexdigest(),
                p.stat().st_mtime_ns,
            )
        else:
            out[p.relative_to(folder).as_posix()] = ("dir", 0)
    return out


def test_round_trip_keeps_every_field(tmp_path):
    run = busy_run()
    state = run.state(METRICS)
    folder = write_checkpoint(tmp_path, state, trainer=fake_trainer)
    assert folder == tmp_path / "checkpoints" / "step-00000001"
    ck = read_checkpoint(tmp_path, protocol=run.protocol)
    assert (ck.steps, ck.version, ck.ps_version, ck.path) == (1, 1, 1, folder)
    assert ck.staleness == state.staleness  # field by field
    assert pack_plain(ck.trajectories) == pack_plain(state.trajectories)
    assert ck.trajectories["trajectories"]["tokens"].dtype == np.int32
    assert ck.sampler == {"drawn": 8} and list(ck.metrics) == METRICS
    assert ck.trainer_dir == folder / "trainer"
    assert json.loads((ck.trainer_dir / "state.json").read_text())["version"] == 1
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {
        "run.msgpack",
        "staleness.msgpack",
        "trajectories.msgpack",
        "trainer/model.safetensors",
        "trainer/optimizer.pt",
        "trainer/state.json",
    }
    assert manifest["protocol"]["eta"] == 2 and manifest["format"] == 1
    assert read_manifest(folder) == manifest and manifest["written_at"]  # what status shows


def test_a_cut_that_is_not_consistent_is_not_written(tmp_path):
    state = busy_run().state()
    with pytest.raises(CheckpointError, match="not a consistent cut"):
        write_checkpoint(tmp_path, replace(state, version=state.version + 1))
    with pytest.raises(CheckpointError, match="ahead"):
        write_checkpoint(tmp_path, replace(state, ps_version=state.version + 1))
    assert list_checkpoints(tmp_path) == []


def test_older_checkpoints_are_pruned_and_a_repeated_step_gets_a_new_name(tmp_path):
    state = busy_run().state()
    for steps in (1, 2, 3):
        write_checkpoint(tmp_path, replace(state, steps=steps), keep=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-00000002", "step-00000003"]
    again = write_checkpoint(tmp_path, replace(state, steps=3), keep=3)
    assert again.name == "step-00000003-1" and find_checkpoint(tmp_path) == again
    assert find_checkpoint(tmp_path / "checkpoints") == again
    assert find_checkpoint(tmp_path / "checkpoints" / "step-00000002").name == "step-00000002"


def test_a_failure_between_files_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    state = busy_run().state()
    first = write_checkpoint(tmp_path, state)
    before = tree(tmp_path)

    def broken_trainer(folder: Path) -> None:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half a model")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, replace(state, steps=2), trainer=broken_trainer)
    real_write = ckpt_module._write_file
    calls = []

    def fail_second(path: Path, data: bytes) -> None:
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError("killed between files")
        real_write(path, data)

    monkeypatch.setattr(ckpt_module, "_write_file", fail_second)
    with pytest.raises(OSError, match="between files"):
        write_checkpoint(tmp_path, replace(state, steps=2))
    assert tree(tmp_path) == before  # no debris, the first checkpoint untouched
    assert read_checkpoint(tmp_path).path == first


WRITER = """
import os, sys
from dataclasses import replace
from pathlib import Path
from staleflow.recovery import write_checkpoint
from tests.staleflow.recovery.runs import busy_run

state = busy_run().state()
write_checkpoint(sys.argv[1], state)

def trainer(folder: Path) -> None:
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.write(b"x" * 100_000)
        f.flush()
        print("writing", flush=True)  # the parent kills us now
        sys.stdin.read()  # never returns before the kill

write_checkpoint(sys.argv[1], replace(state, steps=2), trainer=trainer)
"""


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[3],
        env=env,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "writing"  # synchronised, no sleep
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    debris = list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert len(debris) == 1 and (debris[0] / "trainer" / "model.safetensors").exists()
    ck = read_checkpoint(tmp_path)
    assert ck.steps == 1 and ck.path.name == "step-00000001"
    # the next writer clears the debris of the dead one
    write_checkpoint(tmp_path, replace(busy_run().state(), steps=3))
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("eta", 3),
        ("batch_size", 4),
        ("group_size", 1),
        ("batch_redundancy", 0.5),
        ("group_redundancy", 0.25),
    ],
)
def test_a_run_with_other_protocol_settings_is_refused_naming_the_key(tmp_path, key, value):
    run = busy_run()
    write_checkpoint(tmp_path, run.state())
    before = tree(tmp_path)
    other = replace(run.protocol, **{key: value})
    with pytest.raises(ProtocolMismatch, match=f"{key}=") as info:
        read_checkpoint(tmp_path, protocol=other)
    assert info.value.key == key and info.value.given == value
    assert tree(tmp_path) == before


def _corrupt_cases():
    def flip_byte(folder: Path) -> None:
        f = folder / "trajectories.msgpack"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    def truncate(folder: Path) -> None:
        f = folder / "staleness.msgpack"
        f.write_bytes(f.read_bytes()[:-5])

    def remove(folder: Path) -> None:
        (folder / "run.msgpack").unlink()

    def add(folder: Path) -> None:
        (folder / "stray.txt").write_text("?")

    def garble_manifest(folder: Path) -> None:
        (folder / "MANIFEST.json").write_text("{not json")

    def edit_protocol(folder: Path) -> None:  # made to match another run's settings
        m = json.loads((folder / "MANIFEST.json").read_text())
        m["protocol"]["eta"] = 5
        (folder / "MANIFEST.json").write_text(json.dumps(m))

    return [
        (flip_byte, CorruptCheckpoint, "trajectories.msgpack: size or checksum"),
        (truncate, CorruptCheckpoint, "staleness.msgpack: size or checksum"),
        (remove, CorruptCheckpoint, r"missing \['run.msgpack'\]"),
        (add, CorruptCheckpoint, r"not in the manifest \['stray.txt'\]"),
        (garble_manifest, CorruptCheckpoint, "unreadable"),
        (edit_protocol, CorruptCheckpoint, "manifest was edited"),
    ]


@pytest.mark.parametrize(("damage", "error", "match"), _corrupt_cases())
def test_a_corrupt_checkpoint_is_refused_and_left_as_it_is(tmp_path, damage, error, match):
    run = busy_run()
    folder = write_checkpoint(tmp_path, run.state())
    damage(folder)
    before = tree(tmp_path)
    protocol = StalenessConfig(5, 2, 2) if damage.__name__ == "edit_protocol" else None
    with pytest.raises(error, match=match):
        read_checkpoint(tmp_path, protocol=protocol)
    assert tree(tmp_path) == before


def test_another_format_and_a_folder_that_is_not_a_run_are_refused(tmp_path):
    folder = write_checkpoint(tmp_path / "run", busy_run().state())
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    (folder / "MANIFEST.json").write_text(json.dumps({**manifest, "format": 2}))
    with pytest.raises(IncompatibleCheckpoint, match="newer StaleFlow"):
        read_checkpoint(folder)
    (tmp_path / "notes").mkdir()
    for path in (tmp_path / "notes", tmp_path / "missing", tmp_path / "notes" / "step-00000001"):
        with pytest.raises(NotACheckpoint, match="--resume takes a run folder"):
            read_checkpoint(path)
    assert not (tmp_path / "notes" / "checkpoints").exists()


def test_the_embedded_trainer_writes_its_own_part(tmp_path):
    """The real trainer saves into the checkpoint being written, and loads from it."""
    pytest.importorskip("torch")
    from staleflow.config import TrainerConfig
    from staleflow.models import build_arithmetic_model
    from staleflow.trainers.embedded import EmbeddedTrainer

    def trainer(seed: int) -> EmbeddedTrainer:
        model, tokenizer = build_arithmetic_model("micro", seed=seed)
        return EmbeddedTrainer(model, TrainerConfig(), pad_id=tokenizer.pad_id)

    saved = trainer(0)
    write_checkpoint(tmp_path, busy_run().state(), trainer=saved.save_checkpoint)
    ck = read_checkpoint(tmp_path)
    assert ck.trainer_dir is not None and (ck.trainer_dir / "optimizer.pt").is_file()
    other = trainer(7)
    other.load_checkpoint(ck.trainer_dir)
    want, got = saved.export_weights(), other.export_weights()
    assert all(np.array_equal(want[k], got[k]) for k in want)
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temporary folders left
