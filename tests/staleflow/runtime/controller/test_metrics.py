"""The rollout time shares of the step records (Table 3) cover the whole run: an
instance counts its own seconds from its start, so a lost one's seconds, a removed one's
and those of the run before a resume are carried by ``StepMetrics``; the shares'
denominator follows the fleet's size."""

from __future__ import annotations

import pytest

from coordinator.cycle import CycleStats
from staleflow.rollout.instance import InstanceTimes
from staleflow.runfolder.step_record import StepRecord
from staleflow.runtime.controller.metrics import StepMetrics
from staleflow.runtime.interface import StepReport

REPORT = StepReport(
    version=1, wait_s=0.0, train_s=0.5, push_wait_s=0.0, trajectories=4, tokens=40, staleness={0: 4}
)


def _times(decode: float, prefill: float = 0.0, pull: float = 0.0) -> InstanceTimes:
    return InstanceTimes(
        busy_s=decode + prefill,
        idle_s=0.0,
        prefill_s=prefill,
        decode_s=decode,
        prefill_tokens=0,
        decode_tokens=0,
        load_s=pull,
        finished=0,
        command_s={"pull": pull},
    )


def _step(m: StepMetrics, now: float, times: dict[int, InstanceTimes]) -> StepRecord:
    return m.on_step(
        REPORT,
        now=now,
        instance_times=times,
        command_seconds={},
        coordinator=CycleStats(cycles=1, discarded=0, commands=0, last_decision_s=0.0),
        ps_version=1,
    )


def test_a_lost_instance_restarted_under_its_id_keeps_its_seconds():
    m = StepMetrics([0, 1], started=0.0)
    first = _step(m, 4.0, {0: _times(3.0, pull=0.5), 1: _times(2.0)})
    assert first.time_share["decode"] == pytest.approx(5.0 / 8)
    m.instance_lost(0)  # lost: its seconds of the last step stay
    # its successor under the same id counts from zero; instance 1 did not answer this
    # time (it keeps its latest seconds until it is declared lost)
    second = _step(m, 8.0, {0: _times(1.0, pull=0.25)})
    assert second.time_share["decode"] == pytest.approx((3.0 + 1.0 + 2.0) / 16)
    assert second.time_share["pull"] == pytest.approx(0.75 / 16)
    third = _step(m, 12.0, {0: _times(2.0), 1: _times(5.0)})
    assert third.time_share["decode"] == pytest.approx((3.0 + 2.0 + 5.0) / 24)


def test_a_removed_instance_counts_its_last_seconds_and_leaves_the_denominator():
    m = StepMetrics([0, 1, 2], started=0.0)
    _step(m, 4.0, {i: _times(2.0) for i in range(3)})
    m.instance_removed(2, _times(3.0))  # asked as it left: a second more than at the step
    rec = _step(m, 8.0, {0: _times(4.0), 1: _times(4.0)})
    assert rec.time_share["decode"] == pytest.approx((3.0 + 4.0 + 4.0) / (4 * 3 + 4 * 2))


def test_a_resumed_run_goes_on_with_the_seconds_before_the_stop():
    m = StepMetrics([0, 1], started=0.0)
    records = [
        _step(m, 4.0, {0: _times(3.0, prefill=0.5), 1: _times(2.0, pull=1.0)}),
        _step(m, 10.0, {0: _times(8.0, prefill=1.0), 1: _times(7.0, pull=1.5)}),
    ]
    resumed = StepMetrics([0, 1], started=500.0)  # another process, another clock
    resumed.continue_from([StepRecord.from_flat(r.to_flat()) for r in records])
    rec = _step(resumed, 504.0, {0: _times(3.0), 1: _times(2.0, pull=0.5)})
    assert rec.step == 3 and rec.elapsed_s == pytest.approx(14.0)
    total = 14.0 * 2
    assert rec.time_share["decode"] == pytest.approx((15.0 + 5.0) / total)
    assert rec.time_share["prefill"] == pytest.approx(1.0 / total)
    assert rec.time_share["pull"] == pytest.approx(2.0 / total)


def test_a_second_report_of_the_same_loss_takes_nothing_twice():
    m = StepMetrics([0], started=0.0)
    _step(m, 2.0, {0: _times(1.5)})
    m.instance_lost(0)
    m.instance_lost(0)
    rec = _step(m, 4.0, {0: _times(0.5)})
    assert rec.time_share["decode"] == pytest.approx(2.0 / 4)


def test_an_episode_cut_by_either_limit_counts_as_truncated_as_a_response_cut_by_length():
    from staleflow.runtime.interface import Rewarded

    m = StepMetrics([0], started=0.0)
    for i, reason in enumerate(["stop", "length", "done", "max_tokens", "max_turns", "env_error"]):
        m.on_rewarded(Rewarded(i, 0, 0, 0.0, "", 8, reason, 0))
    assert _step(m, 1.0, {0: _times(1.0)}).truncated == 3


def test_multi_turn_episodes_have_their_own_counts_and_single_turn_runs_none():
    from staleflow.runtime.interface import Rewarded

    m = StepMetrics([0], started=0.0)
    m.on_rewarded(Rewarded(0, 0, 0, 1.0, "", 8, "stop", 0))
    single = _step(m, 1.0, {0: _times(1.0)})
    assert (single.turns_mean, single.tool_calls, single.env_errors, single.tool_wait_s) == (
        None, None, None, None,
    )  # fmt: skip
    m.on_rewarded(Rewarded(1, 0, 0, 1.0, "", 40, "done", 0, turns=2, tool_calls=1, tool_wait_s=0.5))
    m.on_rewarded(
        Rewarded(2, 0, 0, 0.0, "", 60, "max_turns", 0, turns=4, tool_calls=4, env_errors=2,
                 tool_wait_s=1.5)
    )  # fmt: skip
    rec = _step(m, 2.0, {0: _times(2.0)})
    assert (rec.turns_mean, rec.tool_calls, rec.env_errors, rec.tool_wait_s) == (3.0, 5, 2, 2.0)
    assert StepRecord.from_flat(rec.to_flat()) == rec  # the env/* keys read back


def _spec(times: InstanceTimes, v: int, d: int, a: int) -> InstanceTimes:
    from dataclasses import replace

    from staleflow.engines.drafts import SpeculationStats

    return replace(times, speculation=SpeculationStats(v, d, a))


def _spec_keys(rec: StepRecord) -> dict[str, float]:
    """The totals (not the per-method counters)."""
    return {
        k: v
        for k, v in rec.to_flat().items()
        if k.startswith("speculation/") and not k.startswith("speculation/method/")
    }


def _by_method(times: InstanceTimes, **per: tuple[int, int, int]) -> InstanceTimes:
    from dataclasses import replace

    from staleflow.engines.drafts import SpeculationStats

    stats = {m: SpeculationStats(*c) for m, c in per.items()}
    return replace(
        times,
        speculation=sum(stats.values(), SpeculationStats()),
        speculation_by_method=stats,
    )


def _method_keys(rec: StepRecord) -> dict[str, float]:
    return {
        k.removeprefix("speculation/method/"): v
        for k, v in rec.to_flat().items()
        if k.startswith("speculation/method/")
    }


def test_speculation_counters_per_draft_method_over_the_instances_and_a_resume():
    """A race copy may draft with another method than its original: the record counts
    each method's verifications, drafted and accepted tokens over the instances (those
    gone included) and across a resume; the totals are their sums."""
    m = StepMetrics([0, 1], started=0.0)
    first = _step(
        m,
        1.0,
        {
            0: _by_method(_times(1.0), group=(4, 20, 10)),
            1: _by_method(_times(1.0), own=(2, 8, 1), group=(1, 4, 4)),
        },
    )
    assert _method_keys(first) == {
        "group/verifications": 5.0, "group/drafted": 24.0, "group/accepted": 14.0,
        "own/verifications": 2.0, "own/drafted": 8.0, "own/accepted": 1.0,
    }  # fmt: skip
    assert _spec_keys(first)["speculation/accepted"] == 15.0
    m.instance_lost(1)  # its counts stay per method
    second = _step(m, 2.0, {0: _by_method(_times(1.0), group=(5, 24, 12), off=(0, 0, 0))})
    keys = _method_keys(second)
    assert (keys["group/accepted"], keys["own/accepted"]) == (16.0, 1.0)
    resumed = StepMetrics([0], started=100.0)
    resumed.continue_from([StepRecord.from_flat(r.to_flat()) for r in (first, second)])
    rec = _step(resumed, 101.0, {0: _by_method(_times(1.0), own=(1, 3, 3))})
    keys = _method_keys(rec)
    assert (keys["group/accepted"], keys["own/accepted"], keys["own/drafted"]) == (16.0, 4.0, 11.0)
    assert _spec_keys(rec)["speculation/accepted"] == 20.0


def test_speculation_counters_are_summed_over_the_instances_and_the_run():
    """Each instance counts its verified drafts from its start: the record sums the live
    instances' latest (one that did not answer keeps its last), those lost or removed,
    and those before a resume; without speculation there are no such keys."""
    m = StepMetrics([0, 1, 2], started=0.0)
    assert _spec_keys(_step(m, 1.0, {i: _times(1.0) for i in range(3)})) == {}
    assert m.speculation_totals() is None  # what the coordinator's cost model is given
    first = _step(m, 2.0, {0: _spec(_times(1.0), 4, 20, 10), 1: _spec(_times(1.0), 1, 8, 2)})
    assert _spec_keys(first) == {
        "speculation/verifications": 5.0,
        "speculation/drafted": 28.0,
        "speculation/accepted": 12.0,
        "speculation/wasted": 16.0,
        "speculation/accepted_per_verification": 12 / 5,
    }
    assert m.speculation_totals() == (5, 28, 12)
    m.instance_lost(0)  # its counts stay; its successor counts from zero
    m.instance_removed(1, _spec(_times(1.0), 2, 10, 3))  # asked as it left
    second = _step(m, 3.0, {0: _spec(_times(1.0), 1, 4, 4), 2: _spec(_times(1.0), 1, 2, 0)})
    assert _spec_keys(second)["speculation/verifications"] == 4 + 2 + 1 + 1
    assert _spec_keys(second)["speculation/accepted"] == 10 + 3 + 4 + 0
    third = _step(m, 4.0, {2: _spec(_times(1.0), 2, 4, 1)})  # instance 0 did not answer
    assert _spec_keys(third)["speculation/drafted"] == 20 + 10 + 4 + 4
    resumed = StepMetrics([0], started=100.0)
    resumed.continue_from([StepRecord.from_flat(r.to_flat()) for r in (first, second, third)])
    rec = _step(resumed, 101.0, {0: _spec(_times(1.0), 1, 1, 1)})
    assert _spec_keys(rec)["speculation/accepted"] == 10 + 3 + 4 + 1 + 1


def test_a_step_record_has_the_cpu_time_of_the_decisions_made_during_it():
    m = StepMetrics([0], started=0.0)
    stats = CycleStats(cycles=3, discarded=0, commands=0, decisions=3)
    stats.recent_cpu_s.extend([0.001, 0.004, 0.002])

    def step(now: float) -> StepRecord:
        return m.on_step(
            REPORT,
            now=now,
            instance_times={0: _times(1.0)},
            command_seconds={},
            coordinator=stats,
            ps_version=1,
        )

    first = step(4.0)
    assert first.decisions == 3
    assert first.decision_ms == pytest.approx(2.0) and first.decision_ms_max == pytest.approx(4.0)
    assert first.scalars()["coordinator/decision_ms"] == pytest.approx(2.0)
    second = step(8.0)  # no decision since: none to summarise, not the last step's again
    assert second.decisions == 0 and second.decision_ms is None and second.decision_ms_max is None
