"""What ``staleflow launch`` refuses before any actor starts: backends it cannot build yet,
a checkpoint or a prompt file it cannot read. Each is a ``LaunchError`` (the CLI prints its
message, no traceback), never a run with other components than the config named. No Ray."""

from __future__ import annotations

import pytest

from staleflow.config import load_config
from staleflow.runtime.driver.launch import LaunchError, launch


def _without_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every backend the config names is built now; take one away to see the refusal."""
    from staleflow.runtime import backends

    monkeypatch.delitem(backends.TRAINER_POOLS, "megatron")


@pytest.mark.parametrize("override", ["trainer.backend=megatron"], ids=["megatron"])
def test_a_backend_launch_cannot_build_is_refused_by_name(tmp_path, monkeypatch, override):
    _without_megatron(monkeypatch)
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


def test_a_held_out_set_that_cannot_be_read_is_refused_before_anything_starts(tmp_path):
    rows = tmp_path / "test.jsonl"
    rows.write_text('{"question": "1+1=", "solution": "2"}\n')
    cases = (
        (tmp_path / "absent.jsonl", r"held-out set \(eval.path\): .*absent\.jsonl: no such file"),
        (rows, r"no such column \(the prompt column\); .*question, solution: set data.prompt"),
    )
    for path, message in cases:
        cfg = load_config(
            None,
            [
                "eval.every=5",
                f"eval.path={path}",
                "data.prompt_column=problem",
                "data.answer_column=answer",
                f"run_dir={tmp_path / 'runs'}",
            ],
        )
        with pytest.raises(LaunchError, match=message):
            launch(cfg)
    assert not (tmp_path / "runs").exists(), "refused before the run folder is made"


def test_the_cli_prints_the_refusal(tmp_path, capsys, monkeypatch):
    from staleflow.cli import main

    _without_megatron(monkeypatch)
    argv = ["launch", "trainer.backend=megatron", "model.checkpoint=/models/m", "--no-live"]
    assert main([*argv, f"run_dir={tmp_path}", "--no-dashboard"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "staleflow launch failed: trainer.backend=megatron is not implemented" in out


def test_an_address_joins_that_cluster_and_none_starts_a_local_ray_sized_to_the_plan():
    from staleflow.cli import parse_args
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.placement.ray_cluster import init_kwargs, local_cpus

    args = parse_args(["launch", "--address", "ray://head:10001"])
    assert args.address == "ray://head:10001"
    joined = init_kwargs(load_config(None, [f"address={args.address}"]).address, 4)
    assert joined["address"] == "ray://head:10001" and "num_cpus" not in joined
    local = init_kwargs("", 4)
    assert local["address"] == "local" and local["num_cpus"] == 4  # never another's cluster
    # a local Ray always holds the plan's CPU asks (they only gate scheduling there)
    plan = plan_run(load_config(None, ["rollout.instances=40"])).placement.plan
    assert local_cpus(plan.totals()["CPU"]) >= plan.totals()["CPU"] == 40 + 1 + 1 + 1 + 2


def test_an_actor_that_fails_to_start_is_a_launch_error_and_leaves_no_run_folder(
    tmp_path, monkeypatch
):
    from staleflow.runtime.driver import launch as launching
    from staleflow.runtime.driver.run import Run

    def failing_start(self, model, tokenizer, dataset, *rest):
        raise RuntimeError("ray.exceptions.ActorDiedError: ...\nPSWorker: no shared memory left")

    monkeypatch.setattr(Run, "start", failing_start)
    monkeypatch.setattr(launching, "place", _placed_nowhere)
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'runs'}",
            "model.preset=micro",
            "model.warmup=false",
            "eval_problems=0",
        ],
    )
    with pytest.raises(LaunchError, match=r"actors could not start: .*no shared memory left"):
        launching.launch(cfg)
    assert not any(tmp_path.iterdir()), "a launch that never trained leaves no folder behind"


def _placed_nowhere(request, phase):
    """``place`` without Ray: a cluster that starts nothing, a placement of no node."""
    from staleflow.runtime.placement.fitting import Placement

    class NoCluster:
        ray = None

        def shutdown(self) -> None:
            pass

    return NoCluster(), Placement((), ())


def test_the_run_folder_holds_the_resolved_config(tmp_path):
    from staleflow.runfolder.step_record import StepRecord, read_records
    from staleflow.runfolder.writer import RunOutput

    cfg = load_config(None, [f"run_dir={tmp_path}"])
    out = RunOutput.create(cfg)
    rec = StepRecord(step=1, version=0, elapsed_s=1.5, staleness={0: 8})
    out.record(rec)
    out.close(failed=True)  # a failure after a step keeps the folder
    # rerunnable, no "auto" left to guess
    assert cfg.reward.kind == "auto"
    assert load_config(out.path / "config.yaml", []).reward.kind == "arithmetic"
    assert read_records(out.path / "metrics.jsonl") == [rec]  # one line, read back whole


def test_with_ones_own_checkpoint_launch_says_it_loads_it_and_warms_nothing_up(tmp_path):
    from staleflow.models import build_arithmetic_model, save_pretrained
    from staleflow.runtime.driver.launch import prepare_policy
    from staleflow.runtime.driver.run_plan import plan_run

    model, tokenizer = build_arithmetic_model("micro")
    save_pretrained(model, tokenizer, tmp_path / "ckpt")
    plan = plan_run(load_config(None, [f"model.checkpoint={tmp_path / 'ckpt'}"]))
    said: list[str] = []
    _, _, facts = prepare_policy(plan.model, plan.task, said.append)
    assert said == [f"loading the policy from {tmp_path / 'ckpt'}"]
    assert facts == {"source": str(tmp_path / "ckpt")}
    said.clear()
    plan = plan_run(load_config(None, ["model.preset=micro", "model.warmup=false"]))
    prepare_policy(plan.model, plan.task, said.append)
    assert said == ["building the built-in micro model, untrained (model.warmup=false)"]


def test_the_summary_shows_the_held_out_row_only_when_problems_were_scored():
    from rich.console import Console

    from staleflow.runfolder.run_summary import RunSummary
    from staleflow.runtime.driver.display import summary_table

    def rendered(summary: dict) -> str:
        console = Console(width=200, record=True)
        console.print(summary_table(RunSummary.from_json(summary), eta=3))
        return console.export_text()

    base = {"steps": 2, "elapsed_s": 1.0, "tokens_per_s": 5.0, "staleness_hist": {0: 8}}
    assert "held-out" not in rendered(base)  # a dataset task, or eval_problems=0
    scored = rendered(
        {**base, "eval_problems": 64, "eval_reward_start": 0.2, "eval_reward_end": 0.3}
    )
    assert "held-out reward (64 problems), start → end" in scored and "0.200 → 0.300" in scored
    last = {"step": 10, "mean_at_k": 0.5, "pass_at_k": 0.75, "k": 2, "samples": 4}
    best = {**last, "step": 5, "mean_at_k": 0.625}
    during = rendered({**base, "eval_last": last, "eval_best": best})
    assert "held-out mean@4 / pass@2, last; best" in during
    assert "0.500 / 0.750 (step 10); 0.625 / 0.750 (step 5)" in during


def test_paths_the_run_reads_are_checked_before_anything_starts(tmp_path):
    from staleflow.runtime.driver.launch_checks import preflight
    from staleflow.runtime.driver.run_plan import plan_run

    with pytest.raises(
        LaunchError,
        match=r"cannot load the policy: .*/gone: no such checkpoint directory \(set by model.checkpoint\)",
    ):
        preflight(plan_run(load_config(None, [f"model.checkpoint={tmp_path / 'gone'}"])))
    (tmp_path / "ckpt").mkdir()
    cfg = load_config(
        None,
        [
            f"model.checkpoint={tmp_path / 'ckpt'}",
            "data.task=jsonl",
            f"data.path={tmp_path / 'none.jsonl'}",
        ],
    )
    with pytest.raises(
        LaunchError,
        match=r"cannot read the prompts: .*none\.jsonl: no such file \(set by data.path\)",
    ):
        preflight(plan_run(cfg))
