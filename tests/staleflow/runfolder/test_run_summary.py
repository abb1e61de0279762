"""``summary.json`` through :class:`RunSummary` and :class:`RunLayout` (issue 33): a file
the launcher wrote before the typed record opens and is written back byte for byte, keys
this version does not know are kept, and the simulator's summary shares the common
figures' names and types."""

from __future__ import annotations

import dataclasses
import json
from typing import get_args, get_type_hints

import pytest

from staleflow.dashboard.sim_source import SimSource
from staleflow.runfolder.layout import RunLayout
from staleflow.runfolder.reader import read_summary
from staleflow.runfolder.run_summary import (
    SIM_JSON_KEYS,
    F,
    H,
    RunFigures,
    RunSummary,
    audit_balanced,
)
from staleflow.runtime.driver.launch import summarise as summarise_launch
from staleflow.sim import tiny
from staleflow.sim.summary import Summary
from staleflow.sim.summary import summarise as summarise_sim

# what the launcher wrote before RunSummary (launch.summarise's dict, json.dumps with
# indent=2, sort_keys=True) for a 4-step run: histograms keyed by strings, nulls kept
OLD = {
    "audit": {"created": 8},
    "corrected_frac": None,
    "elapsed_s": 4.0,
    "launch": "abc123",
    "on_policy_tokens": False,
    "placement": {"nodes": 1},
    "prepare_s": 1.5,
    "resume_from": "runs/x/checkpoints/step-4",
    "reward_end": None,
    "reward_start": None,
    "rollout_idle_ratio": None,
    "source": "tiny (untrained)",
    "staleness_hist": {"0": 16, "1": 16},
    "staleness_max": 1,
    "staleness_mean": 0.5,
    "steps": 4,
    "stopped": False,
    "time_share": {},
    "token_staleness_hist": {"0": 160, "1": 32},
    "tokens_per_s": None,
    "trainer_idle_ratio": 0.0,
    "warmup_accuracy": None,
}


def _file_text(data: dict[str, object]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def test_an_old_summary_json_opens_typed_and_is_written_back_unchanged(tmp_path):
    (tmp_path / "summary.json").write_text(_file_text(OLD))
    got = RunLayout(tmp_path).read_summary()
    assert got is not None
    assert got.steps == 4 and got.staleness_hist == {0: 16, 1: 16}
    assert got.token_staleness_hist == {0: 160, 1: 32} and got.staleness_mean == 0.5
    assert got.launch == "abc123" and got.stopped is False and got.audit == {"created": 8}
    assert got.tokens_per_s is None and got.trainer_idle_ratio == 0.0 and got.extra == {}
    assert read_summary(tmp_path) == got  # the reader's function goes through the layout
    out = tmp_path / "again"
    out.mkdir()
    RunLayout(out).write_summary(got)
    assert (out / "summary.json").read_text() == _file_text(OLD)


def test_a_run_without_a_step_keeps_only_its_facts():
    old = {"launch": "l", "source": "s", "steps": 0, "stopped": True}
    got = RunSummary.from_json(old)
    assert got.elapsed_s is None and got.staleness_hist is None
    assert got.to_json() == old  # no step figure is added as null


def test_unknown_keys_are_kept_and_written_back(tmp_path):
    newer = {**OLD, "kl_mean": 0.01, "per_pool": {"rollout": 2}}
    got = RunSummary.from_json(newer)
    assert got.extra == {"kl_mean": 0.01, "per_pool": {"rollout": 2}}
    RunLayout(tmp_path).write_summary(got)
    assert json.loads((tmp_path / "summary.json").read_text()) == newer


def test_missing_keys_read_as_none_and_stay_missing():
    older = {"steps": 2, "tokens_per_s": 12.5, "staleness_hist": {"0": 4}}
    got = RunSummary.from_json(older)
    assert got.staleness_mean is None and got.corrected_frac is None and got.launch is None
    assert got.to_json() == {"steps": 2, "tokens_per_s": 12.5, "staleness_hist": {0: 4}}


def test_the_record_round_trips():
    record = RunSummary(
        steps=3,
        tokens_per_s=10.0,
        trainer_idle_ratio=0.25,
        rollout_idle_ratio=0.5,
        elapsed_s=None,
        staleness_hist={0: 2, 2: 1},
        eval_best={"step": 2.0, "mean@k": 0.5},
        launch="x",
    )
    text = json.dumps(record.to_json())  # int keys become strings, as in the file
    assert RunSummary.from_json(json.loads(text)) == record


def test_no_summary_file_reads_as_none(tmp_path):
    assert RunLayout(tmp_path).read_summary() is None
    (tmp_path / "summary.json").write_text("[1, 2]")
    assert RunLayout(tmp_path).read_summary() is None


def test_the_simulator_and_the_launch_share_the_common_figures():
    common = [f.name for f in dataclasses.fields(RunFigures)]
    assert common == [
        "steps",
        "tokens_per_s",
        "trainer_idle_ratio",
        "rollout_idle_ratio",
        "elapsed_s",
        "staleness_hist",
    ]
    assert issubclass(Summary, RunFigures) and issubclass(RunSummary, RunFigures)
    hints = get_type_hints(RunFigures)
    assert hints["steps"] is int and hints["staleness_hist"] is H
    assert all(hints[n] is F for n in common[1:-1])
    # bound per record: the simulator always has the figure; a launch may lack it
    assert get_args(Summary.__orig_bases__[0]) == (float, dict[int, int])  # type: ignore[attr-defined]
    assert get_args(RunSummary.__orig_bases__[0]) == (  # type: ignore[attr-defined]
        float | None,
        dict[int, int] | None,
    )
    # the same names reach summary.json; the simulator's JSON renames only what
    # SIM_JSON_KEYS says
    assert set(common) <= set(RunSummary.from_json(OLD).to_json())
    assert set(SIM_JSON_KEYS) <= set(common)


def test_a_simulated_run_gives_the_same_figures_to_both_summaries():
    """The launch's summary, computed by the launcher's own ``summarise`` from the step
    records a simulated run yields (the dashboard's sim source), and the simulator's
    ``Summary`` of that run agree on the shared figures, read under the same names."""
    src = SimSource(tiny(eta=1, steps=4), speed=1e6).start()
    try:
        assert src.wait(lambda live: live.finished)
        records = src.records(0, 100).items
    finally:
        src.close()
    run = summarise_launch(records, {})
    sim = summarise_sim(src.cluster)
    assert run.steps == sim.steps == 4
    assert run.staleness_hist == sim.staleness_hist and max(sim.staleness_hist) <= 1
    assert sum(sim.staleness_hist.values()) == sum(r.trajectories or 0 for r in records)
    assert run.elapsed_s == sim.elapsed_s
    assert run.tokens_per_s == pytest.approx(sim.tokens_per_s)
    # and each reaches its file under that name (the simulator's elapsed_s as "seconds")
    assert run.to_json()["staleness_hist"] == run.staleness_hist
    sim_json = json.loads(json.dumps(sim.as_dict()))
    assert sim_json["seconds"] == sim.elapsed_s and "elapsed_s" not in sim_json
    assert sim_json["staleness_hist"] == {str(k): n for k, n in sim.staleness_hist.items()}
    assert sim_json["staleness"] == {str(k): n for k, n in sim.staleness.items()}  # groups


def test_an_audit_balances_only_when_every_created_trajectory_is_accounted_for() -> None:
    # a finished 3-step run's audit as summary.json holds it (issue 36's real runs)
    audit = {
        "created": 52224,
        "consumed": 51200,
        "completed": 768,
        "queued": 256,
        "aborted": 0,
        "filtered": 0,
        "routed": 0,
        "on_instances": 0,
        "rewarding": 0,
    }
    assert audit_balanced(audit)
    assert audit_balanced(audit | {"aborted": 16, "created": 52240})  # aborted is accounted
    assert not audit_balanced(audit | {"consumed": 51199})  # one trajectory unaccounted for
    assert not audit_balanced(audit | {"created": 52225})
    # still routed, on an instance or rewarding after the stop: the run lost track of it
    for left in ("routed", "on_instances", "rewarding"):
        assert not audit_balanced(audit | {left: 1, "created": 52225})
    assert not audit_balanced(None) and not audit_balanced({})
