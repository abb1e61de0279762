"""Building the per-step records of a real run (:class:`~staleflow.runfolder.step_record.StepRecord`).

Time shares follow Table 3: every rollout instance-second of the run so far is split into
Pull, Route, Interrupt (the coordinator's commands, timed by the executor's planes),
prefill and decode (timed by the engine), and idle. An instance counts its own seconds
from its start, so the seconds of one that was lost (and restarted under its id) and
those of the run before a resume are carried here: the shares cover the whole run.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.cycle import CycleStats
from coordinator.seer import ProbeAccuracy
from staleflow.engines.drafts import SpeculationStats
from staleflow.envs.base import TRUNCATIONS
from staleflow.rollout.instance import InstanceTimes
from staleflow.runfolder.step_record import (
    TABLE3,
    StepRecord,
    idle_ratio,
    record_key,
    speculation_counts,
    speculation_keys,
    speculation_method_counts,
    speculation_method_keys,
)
from staleflow.runtime.interface import Rewarded, StepReport

__all__ = ["TABLE3", "StepMetrics"]


@dataclass(slots=True)
class _Window:
    """Rollout-side counts since the last training step."""

    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    errors: int = 0
    truncated: int = 0
    episodes: int = 0  # multi-turn episodes among the rewarded
    turns: int = 0
    tool_calls: int = 0
    env_errors: int = 0
    tool_wait_s: float = 0.0


class StepMetrics:
    def __init__(self, instances: Sequence[int], started: float) -> None:
        self.instances = list(instances)
        self.started = started
        self.records: list[StepRecord] = []
        self.staleness_total: Counter[int] = Counter()
        self.rewarded_total = 0
        self.trained_tokens = 0
        self._window = _Window()
        self._last_step_at = started
        # Table 3 seconds of instances that are gone (lost, removed, or before a resume),
        # and each live instance's latest: an instance's own counters start at zero
        self._carried: Counter[str] = Counter()
        self._latest: dict[int, dict[str, float]] = {}
        self._instance_s = 0.0  # the shares' denominator: instances x seconds, summed
        # speculation's counters per draft method, kept as the seconds are: each live
        # instance's latest (they count from its start) and those of instances gone;
        # None: speculation off
        self._spec_carried: dict[str, SpeculationStats] | None = None
        self._spec_latest: dict[int, dict[str, SpeculationStats]] = {}

    def continue_from(self, records: Sequence[StepRecord]) -> None:
        """A resumed run (``docs/recovery.md``): step numbers, elapsed time, trained
        tokens, the staleness totals and the rollout time shares go on from a
        checkpoint's ``records``."""
        if not records:
            return
        self.records = list(records)
        last = records[-1]
        self.started -= last.elapsed_s
        self.trained_tokens = sum(r.tokens or 0 for r in records)
        for r in records:
            self.staleness_total.update(r.staleness)
        self._instance_s = last.elapsed_s * max(len(self.instances), 1)
        shares = last.time_share
        self._carried.update({k: shares[k] * self._instance_s for k in TABLE3 if k in shares})
        counts = speculation_counts(last.extra)
        if counts is not None:
            per = {
                m: SpeculationStats(*c) for m, c in speculation_method_counts(last.extra).items()
            }
            rest = SpeculationStats(*counts) - sum(per.values(), SpeculationStats())
            if rest.verifications or rest.drafted:  # a record from before the methods
                per["unrecorded"] = rest
            self._spec_carried = per

    def instance_lost(self, inst: int) -> None:
        """``inst`` is gone: its seconds up to the last step stay in the shares (those
        since are not known), its slot stays in the denominator until it is back, and
        its successor under the same id counts from zero."""
        self._carried.update(self._latest.pop(inst, {}))
        self._carry_speculation(self._spec_latest.pop(inst, None))

    def instance_removed(self, inst: int, times: InstanceTimes | None) -> None:
        """``inst`` left the run (elastic rollout): ``times``, its last (asked as it
        left; None if it could not answer), stay in the shares; its slot goes."""
        last = self._latest.pop(inst, {})
        self._carried.update(_seconds(times) if times is not None else last)
        spec = self._spec_latest.pop(inst, None)
        self._carry_speculation(_by_method(times) if times is not None else spec)
        self.instances = [i for i in self.instances if i != inst]

    def _carry_speculation(self, stats: Mapping[str, SpeculationStats] | None) -> None:
        if stats is not None:
            self._spec_carried = _add(self._spec_carried or {}, stats)

    def instance_joined(self, inst: int) -> None:
        if inst not in self.instances:
            self.instances.append(inst)

    def on_rewarded(self, r: Rewarded) -> None:
        self.rewarded_total += 1
        w = self._window
        w.rewards.append(r.reward)
        w.lengths.append(r.response_len)
        w.errors += bool(r.error)
        w.truncated += r.finish_reason in TRUNCATIONS
        if r.turns:
            w.episodes += 1
            w.turns += r.turns
            w.tool_calls += r.tool_calls
            w.env_errors += r.env_errors
            w.tool_wait_s += r.tool_wait_s

    def on_step(
        self,
        report: StepReport,
        *,
        now: float,
        instance_times: Mapping[int, InstanceTimes],
        command_seconds: Mapping[str, float],
        coordinator: CycleStats,
        ps_version: int,
        instance_versions: Mapping[int, int] | None = None,
        totals: Mapping[str, float] | None = None,
        probes: ProbeAccuracy | None = None,
    ) -> StepRecord:
        """The record of the step ``report`` trained; ``totals`` (the ``recovery/*``
        counts so far) travel in its ``extra``."""
        elapsed = max(now - self.started, 1e-9)
        step_wall = max(now - self._last_step_at, 1e-9)
        self._last_step_at = now
        # the fleet's size now stands for the whole step (joins and removals are rare)
        self._instance_s += step_wall * max(len(self.instances), 1)
        self.trained_tokens += report.tokens
        self.staleness_total.update(report.staleness)
        w, self._window = self._window, _Window()
        idle = {i: idle_ratio(t.idle_s, t.busy_s) for i, t in instance_times.items()}
        # one that did not answer keeps its latest seconds until it is declared lost
        self._latest.update({i: _seconds(t) for i, t in instance_times.items()})
        self._spec_latest.update(
            {i: s for i, t in instance_times.items() if (s := _by_method(t)) is not None}
        )
        seconds = Counter(self._carried)
        for own in self._latest.values():
            seconds.update(own)
        decided = coordinator.take_recent()
        rec = StepRecord(
            step=len(self.records) + 1,
            version=report.version,
            elapsed_s=elapsed,
            step_s=step_wall,
            tokens_per_s=self.trained_tokens / elapsed,
            step_tokens_per_s=report.tokens / step_wall,
            tokens=report.tokens,
            trajectories=report.trajectories,
            trainer_wait_s=report.wait_s,
            trainer_train_s=report.train_s,
            trainer_push_wait_s=report.push_wait_s,
            trainer_idle_ratio=idle_ratio(report.wait_s, max(step_wall - report.wait_s, 0.0)),
            rewarded=len(w.rewards),
            reward_errors=w.errors,
            truncated=w.truncated,
            reward_mean=sum(w.rewards) / len(w.rewards) if w.rewards else None,
            response_len_mean=sum(w.lengths) / len(w.lengths) if w.lengths else None,
            # multi-turn episodes only (None in a single-turn run)
            turns_mean=w.turns / w.episodes if w.episodes else None,
            tool_calls=w.tool_calls if w.episodes else None,
            env_errors=w.env_errors if w.episodes else None,
            tool_wait_s=w.tool_wait_s if w.episodes else None,
            ps_version=ps_version,
            cycles=coordinator.cycles,
            discarded=coordinator.discarded,
            commands=coordinator.commands,
            decisions=decided.count if decided else 0,
            decision_ms=decided.median_ms if decided else None,
            decision_ms_max=decided.max_ms if decided else None,
            # Seer's counters, only where it is on (``probes`` given)
            chunks=sum(t.chunks for t in instance_times.values()) if probes is not None else None,
            probe_error=probes.mean_error if probes is not None and probes.groups else None,
            streamed_groups=report.streamed_groups,
            staleness={int(k): int(n) for k, n in sorted(report.staleness.items())},
            token_staleness={int(k): int(n) for k, n in sorted(report.token_staleness.items())},
            instance_idle={i: r for i, r in sorted(idle.items()) if r is not None},
            instance_version={i: int(v) for i, v in sorted((instance_versions or {}).items())},
            time_share={k: seconds.get(k, 0.0) / self._instance_s for k in TABLE3},
            command_latency_s=dict(command_seconds),
            # the trainer's own metrics (train/loss, ...); the fields above take precedence
            extra={
                **{k: float(v) for k, v in report.metrics.items() if not record_key(k)},
                **{k: float(v) for k, v in (totals or {}).items()},
                **_prefix_reuse(instance_times),
                **self._speculation(),
            },
        )
        self.records.append(rec)
        return rec

    def _speculation(self) -> dict[str, float]:
        """Speculation's counters over the run (live instances' and those gone), absent
        while no instance speculates (``rollout.speculation.method: off``)."""
        per = self._speculation_by_method()
        if per is None:
            return {}
        total = sum(per.values(), SpeculationStats())
        return {
            **speculation_keys(total.verifications, total.drafted, total.accepted),
            **speculation_method_keys(
                {m: (s.verifications, s.drafted, s.accepted) for m, s in per.items()}
            ),
        }

    def speculation_totals(self) -> tuple[int, int, int] | None:
        """(drafts verified, draft tokens, accepted ones) over the run, as the last
        record has them (None: no instance speculates)."""
        per = self._speculation_by_method()
        if per is None:
            return None
        total = sum(per.values(), SpeculationStats())
        return total.verifications, total.drafted, total.accepted

    def _speculation_by_method(self) -> dict[str, SpeculationStats] | None:
        if self._spec_carried is None and not self._spec_latest:
            return None
        per: dict[str, SpeculationStats] = dict(self._spec_carried or {})
        for own in self._spec_latest.values():
            per = _add(per, own)
        return per


def _by_method(t: InstanceTimes) -> dict[str, SpeculationStats] | None:
    """An instance's speculation counters per draft method (None: speculation off); an
    engine that does not tell them apart counts all under its one method, ``all``."""
    if t.speculation_by_method is not None:
        return dict(t.speculation_by_method)
    return None if t.speculation is None else {"all": t.speculation}


def _add(
    a: Mapping[str, SpeculationStats], b: Mapping[str, SpeculationStats]
) -> dict[str, SpeculationStats]:
    return {m: a.get(m, SpeculationStats()) + b.get(m, SpeculationStats()) for m in {*a, *b}}


def _prefix_reuse(instance_times: Mapping[int, InstanceTimes]) -> dict[str, float]:
    """KV reuse across turns, summed over the instances since they started: requests
    that reused a kept prefix and the tokens not prefilled thanks to it. Absent while
    none was reused (a single-turn run, or an engine that cannot tell)."""
    hits = sum(t.prefix_hits for t in instance_times.values())
    saved = sum(t.prefix_tokens for t in instance_times.values())
    if not (hits or saved):
        return {}
    return {"rollout/prefix_hits": float(hits), "rollout/prefix_tokens_saved": float(saved)}


def _seconds(t: InstanceTimes) -> dict[str, float]:
    """One instance's seconds in each of Table 3's rollout columns, from its start.

    Pull / Route / Interrupt count the time each command kept an instance from
    generating (fetching and loading weights; fetching routed trajectories from the TS
    and queueing them; stopping trajectories and returning them to the TS), as the
    instances measure it. The control plane's view of the same commands, which adds the
    RPC and the wait for the decode step in progress, is ``command_latency_s``.
    """
    held = t.command_s
    return {
        "pull": held.get("pull", 0.0),
        "route": held.get("route", 0.0),
        "interrupt": held.get("interrupt", 0.0) + held.get("abort", 0.0),
        "prefill": t.prefill_s,
        "decode": t.decode_s,
    }
