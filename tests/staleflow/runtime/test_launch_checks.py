"""What ``staleflow launch`` refuses before any actor starts: backends it cannot build yet,
a checkpoint or a prompt file it cannot read. Each is a ``LaunchError`` (the CLI prints its
message, no traceback), never a run with other components than the config named. No Ray."""

from __future__ import annotations

import pytest

from staleflow.config import load_config
from staleflow.runtime.launch import LaunchError, launch


@pytest.mark.parametrize(
    "override", ["rollout.backend=sglang", "trainer.backend=megatron"], ids=["sglang", "megatron"]
)
def test_a_backend_launch_cannot_build_is_refused_by_name(tmp_path, override):
    cfg = load_config(None, [override, "model.checkpoint=/models/m", f"run_dir={tmp_path}"])
    key = override.split("=")[0]
    with pytest.raises(LaunchError, match=rf"{key}=\w+ is not implemented .* use {key}=embedded"):
        launch(cfg)
    assert not any(tmp_path.iterdir()), "refused before the run folder is made"


def test_a_checkpoint_that_cannot_be_loaded_is_a_launch_error(tmp_path):
    cfg = load_config(None, [f"model.checkpoint={tmp_path / 'absent'}", f"run_dir={tmp_path}"])
    with pytest.raises(LaunchError, match=r"cannot load the policy: .*no such checkpoint"):
        launch(cfg)


def test_a_prompt_file_that_cannot_be_read_is_a_launch_error(tmp_path):
    from staleflow.models import build_arithmetic_model, save_pretrained

    model, tokenizer = build_arithmetic_model("micro")
    save_pretrained(model, tokenizer, tmp_path / "ckpt")
    cfg = load_config(
        None,
        [
            "data.task=jsonl",
            f"data.path={tmp_path / 'absent.jsonl'}",
            f"model.checkpoint={tmp_path / 'ckpt'}",
            f"run_dir={tmp_path / 'runs'}",
        ],
    )
    with pytest.raises(LaunchError, match=r"cannot read the prompts: .*absent\.jsonl"):
        launch(cfg)


def test_the_cli_prints_the_refusal(tmp_path, capsys):
    from staleflow.cli import main

    argv = ["launch", "rollout.backend=sglang", "model.checkpoint=/models/m", "--no-live"]
    assert main([*argv, f"run_dir={tmp_path}", "--no-dashboard"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "staleflow launch failed: rollout.backend=sglang is not implemented" in out


def test_an_address_joins_that_cluster_and_none_starts_a_local_ray():
    from staleflow.cli import parse_args
    from staleflow.runtime.launch import ray_init_kwargs

    args = parse_args(["launch", "--address", "ray://head:10001"])
    assert args.address == "ray://head:10001"
    joined = ray_init_kwargs(load_config(None, [f"address={args.address}"]))
    assert joined["address"] == "ray://head:10001" and "num_cpus" not in joined
    local = ray_init_kwargs(load_config(None, []))
    # a Ray of its own even where `ray start` runs another: never one that refuses num_cpus
    assert local["address"] == "local" and local["num_cpus"] >= 1


def test_an_actor_that_fails_to_start_is_a_launch_error(tmp_path, monkeypatch):
    from staleflow.runtime import launch as launching

    def failing_start(self, model, tokenizer, dataset, *progress):
        raise RuntimeError("ray.exceptions.ActorDiedError: ...\nPSWorker: no shared memory left")

    monkeypatch.setattr(launching.Run, "start", failing_start)
    monkeypatch.setattr(launching.Run, "shutdown", lambda self: None)
    cfg = load_config(
        None,
        [f"run_dir={tmp_path}", "model.preset=micro", "model.warmup=false", "eval_problems=0"],
    )
    with pytest.raises(LaunchError, match=r"actors could not start: .*no shared memory left"):
        launching.launch(cfg)
    # the run folder's config is the resolved one: rerunnable, no "auto" left to guess
    [saved] = tmp_path.glob("*/config.yaml")
    assert cfg.reward.kind == "auto"
    assert load_config(saved, []).reward.kind == "arithmetic"
