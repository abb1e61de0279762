"""``staleflow launch --resume`` refuses, with the reason, what it cannot continue: a
folder that is not a run, a run whose configuration changes the protocol (eta, batch,
group size, redundancy), a corrupt checkpoint, a run that already took its steps. A
refused resume changes nothing in the folder (every file's bytes and mtime compared).

The run folder is made here without Ray: the real config file and the real checkpoint
format, written from an in-process run of the real manager and TS (``runs.py``), with a
stand-in trainer part (what a trainer writes is its own business)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from staleflow.cli import main
from staleflow.config import load_config, save_config
from staleflow.recovery import list_checkpoints, write_checkpoint
from staleflow.runtime.driver.resume import ResumeError, check_resume
from tests.staleflow.recovery.runs import busy_run

# busy_run's protocol: eta=2, batch 2, group 2
CONFIG = ["eta=2", "batch_size=2", "group_size=2", "steps=10", "model.preset=micro"]


def _trainer_part(folder: Path) -> None:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "runs" / "20261124-000000-eta2"
    folder.mkdir(parents=True)
    save_config(load_config(None, CONFIG), folder / "config.yaml")
    (folder / "metrics.jsonl").write_text('{"step": 1.0}\n')
    run = busy_run()
    write_checkpoint(folder, run.state([{"step": 1.0}]), trainer=_trainer_part)
    return folder


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(folder)): (
            hashlib.sha256(p.read_bytes()).hexdigest(),
            p.stat().st_mtime_ns,
        )
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _refused(capsys, args: list[str], match: str) -> None:
    assert main(["launch", "--no-live", "--no-dashboard", "--resume", *args]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and match in err, err


def test_a_good_run_folder_is_accepted_and_names_its_checkpoint(run_dir):
    cfg, ck = check_resume(run_dir)
    assert (cfg.eta, cfg.batch_size, cfg.group_size) == (2, 2, 2)
    assert ck.steps == 1 and ck.path == list_checkpoints(run_dir)[-1]
    cfg, ck = check_resume(ck.path, ["steps=20"])  # a checkpoint folder names its run
    assert cfg.steps == 20 and ck.trainer_dir is not None


def test_a_folder_that_is_not_a_run_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    before = _snapshot(tmp_path)
    _refused(capsys, [str(tmp_path)], "is not a run folder")
    _refused(capsys, [str(tmp_path / "missing")], "is not a run folder")
    assert _snapshot(tmp_path) == before


def test_a_run_that_never_checkpointed_is_refused(run_dir, capsys):
    for ck in list_checkpoints(run_dir):
        for p in sorted(ck.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        ck.rmdir()
    before = _snapshot(run_dir)
    _refused(capsys, [str(run_dir)], "nothing to resume")
    assert _snapshot(run_dir) == before


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("eta=3", "eta"),
        ("batch_size=4", "batch_size"),
        ("group_size=4", "group_size"),
        ("group_redundancy=0.5", "group_redundancy"),
        ("batch_redundancy=0.5", "batch_redundancy"),
    ],
)
def test_a_config_that_changes_the_protocol_is_refused_naming_the_key(
    run_dir, capsys, override, key
):
    before = _snapshot(run_dir)
    _refused(capsys, [str(run_dir), override], f"written with {key}=")
    assert _snapshot(run_dir) == before


def test_a_corrupt_checkpoint_is_refused(run_dir, capsys):
    ck = list_checkpoints(run_dir)[-1]
    data = bytearray((ck / "trajectories.msgpack").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (ck / "trajectories.msgpack").write_bytes(bytes(data))
    before = _snapshot(run_dir)
    _refused(capsys, [str(run_dir)], "checksum differs")
    assert _snapshot(run_dir) == before
    (ck / "MANIFEST.json").write_text("{not json")
    before = _snapshot(run_dir)
    _refused(capsys, [str(run_dir)], "unreadable")
    assert _snapshot(run_dir) == before


def test_a_run_that_took_its_steps_is_refused_with_how_to_train_more(run_dir, capsys):
    before = _snapshot(run_dir)
    _refused(capsys, [str(run_dir), "steps=1"], "resume with steps=N for N > 1")
    assert _snapshot(run_dir) == before


def test_resume_takes_overrides_not_another_config_file(run_dir, capsys, tmp_path):
    other = tmp_path / "other.yaml"
    save_config(load_config(None, CONFIG), other)
    before = _snapshot(run_dir)
    assert main(["launch", "--resume", str(run_dir), "--config", str(other)]) == 2
    assert "key=value overrides" in capsys.readouterr().err
    assert _snapshot(run_dir) == before
    with pytest.raises(ResumeError, match="cannot read the run's configuration"):
        check_resume(run_dir, ["eta=-1"])


def test_status_shows_where_a_run_can_resume_from(run_dir, tmp_path):
    from rich.console import Console

    from staleflow.dashboard.status import resume_view
    from staleflow.recovery import describe_checkpoints

    good = list_checkpoints(run_dir)[-1]
    broken = run_dir / "checkpoints" / "step-00000009"
    broken.mkdir()
    (broken / "MANIFEST.json").write_text("{}")
    found = describe_checkpoints(run_dir)
    assert [(c.path, c.steps, c.problem == "") for c in found] == [
        (good, 1, True),
        (broken, None, False),
    ]
    console = Console(width=200, record=True)
    console.print(resume_view(run_dir))
    text = console.export_text()
    assert f"staleflow launch --resume {run_dir}" in text and good.name in text
    assert "not a StaleFlow run" in " ".join(text.split())
    console.print(resume_view(tmp_path))
    assert "cannot be resumed" in console.export_text()


def test_a_checkpoint_of_another_trainer_backend_is_refused(run_dir, capsys):
    """The embedded trainer's part cannot start a Megatron pool, nor the reverse: the
    reason names the key to set."""
    before = _snapshot(run_dir)
    _refused(capsys, [str(run_dir), "trainer.backend=megatron"], "trainer.backend=embedded")
    assert _snapshot(run_dir) == before

    def megatron_part(folder: Path) -> None:  # what the Megatron pool writes there
        _trainer_part(folder)
        (folder / "megatron").mkdir()
        (folder / "megatron" / "common.pt").write_bytes(b"sharded")

    write_checkpoint(run_dir, busy_run().state([{"step": 1.0}]), trainer=megatron_part)
    with pytest.raises(ResumeError, match=r"trainer\.backend=megatron"):
        check_resume(run_dir)
