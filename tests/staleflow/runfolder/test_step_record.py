"""The step record: built by ``StepMetrics``, written as one ``metrics.jsonl`` line, read
back by the one reader; lines of earlier runs still read, and bad ones name their file,
line and key. No other module spells a metric key."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest

from coordinator.cycle import CycleStats
from staleflow.rollout.instance import InstanceTimes
from staleflow.runfolder.step_record import (
    RecordError,
    StepRecord,
    filtered_share,
    idle_ratio,
    read_records,
    record_key,
    reward_mean,
    sampling_keys,
    trainer_idle_ratio,
)
from staleflow.runtime.controller.metrics import StepMetrics
from staleflow.runtime.interface import Rewarded, StepReport

ROOT = Path(__file__).resolve().parents[3]

# Written by StepMetrics before the record had a type (commit 8b69c37), from the inputs of
# _step() below: the flat form must not have moved.
OLD_LINE = (
    '{"coordinator/commands": 12.0, "coordinator/cycles": 40.0, "coordinator/decision_ms": 0.5,'
    ' "coordinator/discarded": 1.0, "coordinator/latency_s/pull": 0.5,'
    ' "coordinator/latency_s/route": 0.25, "ps/version": 3.0, "rollout/idle_ratio": 0.375,'
    ' "rollout/idle_ratio/0": 0.25, "rollout/idle_ratio/1": 0.5,'
    ' "rollout/response_len_mean": 8.0, "rollout/reward_errors": 1.0,'
    ' "rollout/reward_mean": 0.6666666666666666, "rollout/rewarded": 3.0,'
    ' "rollout/time_share/commands": 0.1171875, "rollout/time_share/decode": 0.53125,'
    ' "rollout/time_share/interrupt": 0.0703125, "rollout/time_share/prefill": 0.09375,'
    ' "rollout/time_share/pull": 0.03125, "rollout/time_share/route": 0.015625,'
    ' "rollout/truncated": 1.0, "rollout/version/0": 2.0, "rollout/version/1": 1.0,'
    ' "staleness/hist/0": 5.0, "staleness/hist/2": 3.0, "staleness/max": 2.0,'
    ' "staleness/mean": 0.75, "step": 1.0, "throughput/step_tokens_per_s": 24.0,'
    ' "throughput/tokens_per_s": 24.0, "time/elapsed_s": 4.0, "time/step_s": 4.0,'
    ' "train/grad_norm": 1.5, "train/loss": 0.5, "train/tokens": 96.0,'
    ' "train/trajectories": 8.0, "trainer/idle_ratio": 0.125, "trainer/push_wait_s": 0.0,'
    ' "trainer/train_s": 1.25, "trainer/wait_s": 0.5, "version": 2.0}'
)

NEWER_KEYS = {"coordinator/decisions": 1.0, "coordinator/decision_ms_max": 0.5}


def _step() -> StepRecord:
    m = StepMetrics([0, 1], started=100.0)
    for i, (reward, error, finish) in enumerate(
        [(1.0, "", "stop"), (0.0, "boom", "length"), (1.0, "", "stop")]
    ):
        m.on_rewarded(Rewarded(i, 0, 0, reward, error, 7 + i, finish, 0))
    report = StepReport(
        version=2,
        wait_s=0.5,
        train_s=1.25,
        push_wait_s=0.0,
        trajectories=8,
        tokens=96,
        staleness={0: 5, 2: 3},
        metrics={"train/loss": 0.5, "train/tokens": 96.0, "train/grad_norm": 1.5},
    )
    times = {
        0: InstanceTimes(
            3.0, 1.0, 0.5, 2.5, 100, 400, 0.1, 4, {"pull": 0.25, "route": 0.125, "abort": 0.0625}
        ),
        1: InstanceTimes(2.0, 2.0, 0.25, 1.75, 80, 300, 0.1, 3, {"interrupt": 0.5}),
    }
    stats = CycleStats(cycles=40, discarded=1, commands=12, decisions=1)
    stats.recent_cpu_s.append(0.0005)  # one decision during the step, 0.5 ms of CPU
    return m.on_step(
        report,
        now=104.0,
        instance_times=times,
        command_seconds={"pull": 0.5, "route": 0.25},
        coordinator=stats,
        ps_version=3,
        instance_versions={0: 2, 1: 1},
    )


def test_the_built_record_is_typed_and_its_flat_form_has_not_moved():
    rec = _step()
    assert (rec.step, rec.version, rec.elapsed_s, rec.ps_version) == (1, 2, 4.0, 3)
    assert rec.staleness == {0: 5, 2: 3} and rec.staleness_mean == 0.75
    assert rec.staleness_max == 2
    assert rec.instance_idle == {0: 0.25, 1: 0.5} and rec.rollout_idle_ratio == 0.375
    assert rec.instance_version == {0: 2, 1: 1} and rec.instances == [0, 1]
    assert rec.rewarded == 3 and rec.reward_errors == 1 and rec.truncated == 1
    assert rec.trainer_idle_ratio == 0.125  # waited 0.5 s of a 4 s step
    assert rec.time_share["interrupt"] == pytest.approx((0.0625 + 0.5) / 8)  # aborts count
    assert rec.extra == {"train/loss": 0.5, "train/grad_norm": 1.5}  # train/tokens is typed
    # the keys added since: how many decisions the step made and the slowest one's CPU
    # time (decision_ms, once the last decision's wall time, is now their median)
    assert rec.to_flat() == json.loads(OLD_LINE) | NEWER_KEYS


def test_an_old_line_reads_and_round_trips():
    rec = StepRecord.from_json(OLD_LINE)
    assert rec == dataclasses.replace(_step(), decisions=None, decision_ms_max=None)
    assert StepRecord.from_json(rec.to_json()) == rec
    assert json.loads(rec.to_json()) == json.loads(OLD_LINE)


def test_derived_keys_are_recomputed_and_unknown_keys_kept():
    flat = json.loads(OLD_LINE)
    flat |= {"staleness/mean": 9.0, "rollout/idle_ratio": 0.9, "newer/metric": 7.0}
    flat |= {"rollout/idle_ratio/x": 1.0}  # not an instance: kept as it is
    rec = StepRecord.from_flat(flat)
    assert rec.staleness_mean == 0.75 and rec.rollout_idle_ratio == 0.375
    assert rec.extra["newer/metric"] == 7.0 and rec.extra["rollout/idle_ratio/x"] == 1.0
    back = rec.to_flat()
    assert back["newer/metric"] == 7.0 and back["staleness/mean"] == 0.75


def test_a_minimal_record_and_what_it_leaves_unknown():
    rec = StepRecord.from_flat({"step": 1, "version": 0, "time/elapsed_s": 2.5})
    assert rec.tokens_per_s is None and rec.reward_mean is None and rec.staleness == {}
    assert rec.staleness_mean is None and rec.rollout_idle_ratio is None
    assert rec.commands_share is None and rec.time_shares() == {}
    assert rec.to_flat() == {"step": 1.0, "version": 0.0, "time/elapsed_s": 2.5}
    nan = StepRecord.from_flat(
        {"step": 1, "version": 0, "time/elapsed_s": 1, "rollout/reward_mean": "NaN"}
    )
    assert nan.reward_mean is not None and math.isnan(nan.reward_mean)  # a value, kept


@pytest.mark.parametrize(
    ("flat", "message"),
    [
        ({"version": 0, "time/elapsed_s": 1.0}, r"'step' is missing"),
        ({"step": 1, "version": 0, "time/elapsed_s": "soon"}, r"'time/elapsed_s' is not a number"),
        ({"step": 1, "version": 0, "time/elapsed_s": True}, r"'time/elapsed_s' is not a number"),
        ({"step": float("nan"), "version": 0, "time/elapsed_s": 1.0}, r"'step' is nan"),
        ({"step": 1, "version": 0.5, "time/elapsed_s": 1.0}, r"'version' is 0.5: expected a whole"),
        ({"step": 1, "version": 0, "time/elapsed_s": float("inf")}, r"'time/elapsed_s' is inf"),
        (
            {"step": 1, "version": 0, "time/elapsed_s": 1.0, "rollout/version/1": float("nan")},
            r"'rollout/version/1' is nan",
        ),
        (
            {"step": 1, "version": 0, "time/elapsed_s": 1.0, "staleness/hist/0": 2.5},
            r"'staleness/hist/0' is 2.5",
        ),
    ],
)
def test_bad_records_name_the_key(flat, message):
    with pytest.raises(RecordError, match=message):
        StepRecord.from_flat(flat)


def test_bad_lines_name_the_file_and_the_line(tmp_path):
    file = tmp_path / "metrics.jsonl"
    good = _step().to_json()
    file.write_text(f"{good}\n\n{good}\n")
    assert [r.step for r in read_records(file)] == [1, 1]  # blank lines are skipped
    file.write_text(f"{good}\n[1, 2]\n")
    with pytest.raises(RecordError, match=rf"{file} line 2: .*JSON object, got list"):
        read_records(file)
    file.write_text(f"{good}\n{good[:30]}")
    with pytest.raises(RecordError, match=r"line 2: .*not JSON.*is the run still writing"):
        read_records(file)
    file.write_text('{"step": 1, "version": 0}\n')
    with pytest.raises(RecordError, match=r"line 1: .*'time/elapsed_s' is missing"):
        read_records(file)


def test_idle_ratios_have_one_definition():
    assert idle_ratio(1.0, 3.0) == 0.25 and idle_ratio(0.0, 0.0) is None
    steps = [
        StepRecord(step=1, version=0, elapsed_s=4.0, trainer_wait_s=2.0),
        StepRecord(step=2, version=1, elapsed_s=10.0, trainer_wait_s=1.0),
        StepRecord(step=3, version=2, elapsed_s=12.0),  # a source that does not know
    ]
    assert trainer_idle_ratio(steps) == pytest.approx(3.0 / 12.0)
    assert trainer_idle_ratio([]) is None


def test_reward_mean_weights_each_step_by_what_it_rewarded():
    steps = [
        StepRecord(step=1, version=0, elapsed_s=1.0, rewarded=1, reward_mean=1.0),
        StepRecord(step=2, version=1, elapsed_s=2.0, rewarded=3, reward_mean=0.0),
        StepRecord(step=3, version=2, elapsed_s=3.0, rewarded=0),
    ]
    assert reward_mean(steps) == 0.25 and reward_mean(steps[2:]) is None


def test_dynamic_samplings_share_is_per_step_and_over_the_run():
    """Each step's record says how many completed groups were dropped and their share; the
    run's share weighs each step by its completed groups. Runs without it have no keys."""
    steps = [
        StepRecord(step=1, version=0, elapsed_s=1.0, extra=sampling_keys(4, 1, 0)),
        StepRecord(step=2, version=1, elapsed_s=2.0, extra=sampling_keys(2, 2, 1)),
        StepRecord(step=3, version=2, elapsed_s=3.0, extra=sampling_keys(0, 0, 0)),
    ]
    assert steps[0].extra["rollout/filtered_frac"] == 0.25
    assert steps[1].extra["rollout/flat_kept_groups"] == 1.0
    assert steps[2].extra["rollout/filtered_frac"] == 0.0  # nothing completed: no share
    assert filtered_share(steps) == (3, 0.5)
    back = [StepRecord.from_json(r.to_json()) for r in steps]  # metrics.jsonl keeps them
    assert filtered_share(back) == (3, 0.5)
    assert filtered_share([StepRecord(step=1, version=0, elapsed_s=1.0)]) is None


# -- the schema is spelled once ----------------------------------------------------------


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module that are not docstrings (f-string parts included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_no_module_but_the_record_spells_a_metric_key():
    record = ROOT / "staleflow" / "runfolder" / "step_record.py"
    # Trainers name their own train/* metrics (staleflow/trainers/interface.py); the record
    # keeps them in extra, and takes its train/tokens and train/trajectories from the
    # trainer's step report, so a trainer spelling those two shadows nothing.
    trainers = ROOT / "staleflow" / "trainers"
    files = [*(ROOT / "staleflow").rglob("*.py"), *(ROOT / "experiments").glob("*.py")]
    spelled = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in files
        if path != record and trainers not in path.parents
        for line, text in _code_strings(path)
        if "/" in text and text not in ("step", "version") and record_key(text)
    ]
    assert not spelled, "metric keys outside staleflow/runfolder/step_record.py:\n" + "\n".join(
        spelled
    )


def test_the_key_check_can_fail():
    assert record_key("rollout/idle_ratio/") and record_key("time/elapsed_s")
    assert record_key("staleness/mean") and not record_key("train/loss")
