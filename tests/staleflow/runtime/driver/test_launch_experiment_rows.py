"""The rows of the launch experiments (``experiments/launch_eta_sweep.py``,
``experiments/launch_agentic.py``) without a launch: built from what ``launch`` returns,
its typed summary (``RunResult.summary``) and its step records, or from a run folder's
``summary.json`` as an older launcher wrote it."""

from __future__ import annotations

import json

import yaml

from staleflow.runfolder.step_record import StepRecord
from staleflow.runtime.driver.launch import RunResult, summarise
from tests.support.experiments import load


def _records() -> list[StepRecord]:
    return [
        StepRecord(
            step=s,
            version=s - 1,
            elapsed_s=2.0 * s,
            step_s=2.0,
            tokens_per_s=100.0 * s,
            trainer_wait_s=0.5,
            streamed_groups=1,
            staleness={0: 4, 1: 4} if s > 1 else {0: 8},
            instance_idle={0: 0.25, 1: 0.75},
            time_share={"pull": 0.01, "route": 0.02},
            tool_calls=3,
            tool_wait_s=0.5,
            turns_mean=2.0,
        )
        for s in (1, 2, 3, 4)
    ]


def test_a_sweep_row_comes_from_the_typed_summary(tmp_path) -> None:
    script = load("launch_eta_sweep")
    records = _records()
    result = RunResult(tmp_path, records, summarise(records, {"eval_reward_start": 0.25}))
    row = script.sweep_row(result, eta=1, stream=False, fresh=True, seed=7)
    assert (row["eta"], row["stream"], row["freshness"], row["seed"]) == (1, False, True, 7)
    assert row["staleness_hist"] == {0: 20, 1: 12} and row["staleness_mean"] == 12 / 32
    assert row["elapsed_s"] == 8.0 and row["tokens_per_s"] == 400.0
    assert row["trainer_idle_ratio"] == 2.0 / 8.0 and row["rollout_idle_ratio"] == 0.5
    assert row["eval_reward_start"] == 0.25 and row["eval_reward_end"] is None
    assert row["step_s_mean"] == 2.0 and row["streamed_groups"] == 4
    assert row["run_dir"] == str(tmp_path)
    assert row["time_share"] == {"pull": 0.01, "route": 0.02, "commands": 0.03}
    # the JSON the script writes: histogram keys as strings, as before
    assert json.loads(json.dumps(row))["staleness_hist"] == {"0": 20, "1": 12}


def test_an_agentic_row_is_the_same_from_the_result_and_from_an_old_folder(tmp_path) -> None:
    script = load("launch_agentic")
    records = _records()
    # the held-out success the launch scored at the start and the end of the run
    summary = summarise(records, {"eval_reward_start": 0.25, "eval_reward_end": 0.375})
    from_result = script.summarise_run("staleflow", 1, summary, records, tmp_path)
    assert (from_result["held_out_start"], from_result["held_out_end"]) == (0.25, 0.375)
    assert from_result["episodes"] == 32 and from_result["episodes_per_s"] == 32 / 8.0
    assert from_result["staleness_max"] == 1 and from_result["within_eta"] is True
    assert from_result["tool_calls"] == 12 and from_result["turns_mean"] == 2.0
    # a folder an older launcher wrote: summary.json keyed by strings, nulls kept
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump({"eta": 1, "coordinator": {"routing": "throughput"}})
    )
    (tmp_path / "summary.json").write_text(json.dumps(summary.to_json(), sort_keys=True))
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r.to_flat()) + "\n" for r in records)
    )
    assert script.from_folder(tmp_path) == from_result
    # a streamed run's folder is the streamed variant's row
    (tmp_path / "config.yaml").write_text(
        yaml.safe_dump(
            {"eta": 3, "coordinator": {"routing": "throughput"}, "trainer": {"stream": True}}
        )
    )
    assert script.from_folder(tmp_path)["variant"] == "staleflow+stream"
