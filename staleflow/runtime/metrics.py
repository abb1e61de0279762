"""Per-step metric records of a real run (one flat dict per training step).

Keys follow ``area/name``. Time shares follow Table 3: every rollout instance-second of
the run so far is split into Pull, Route, Interrupt (the coordinator's commands, timed
by the executor's planes), prefill and decode (timed by the engine), and idle.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.cycle import CycleStats
from staleflow.rollout.instance import InstanceTimes
from staleflow.runtime.interface import Rewarded, StepReport

TABLE3 = ("pull", "route", "interrupt", "prefill", "decode")


@dataclass(slots=True)
class _Window:
    """Rollout-side counts since the last training step."""

    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    errors: int = 0
    truncated: int = 0


class StepMetrics:
    def __init__(self, instances: Sequence[int], started: float) -> None:
        self.instances = list(instances)
        self.started = started
        self.records: list[dict[str, float]] = []
        self.staleness_total: Counter[int] = Counter()
        self.rewarded_total = 0
        self.trained_tokens = 0
        self._window = _Window()
        self._last_step_at = started

    def continue_from(self, records: Sequence[Mapping[str, float]]) -> None:
        """A resumed run (``docs/recovery.md``): step numbers, elapsed time, trained
        tokens and the staleness totals go on from a checkpoint's ``records``."""
        if not records:
            return
        self.records = [dict(r) for r in records]
        self.started -= float(records[-1].get("time/elapsed_s", 0.0))
        self.trained_tokens = int(sum(r.get("train/tokens", 0.0) for r in records))
        for r in records:
            for key, n in r.items():
                if key.startswith("staleness/hist/"):
                    self.staleness_total[int(key.rsplit("/", 1)[1])] += int(n)

    def on_rewarded(self, r: Rewarded) -> None:
        self.rewarded_total += 1
        w = self._window
        w.rewards.append(r.reward)
        w.lengths.append(r.response_len)
        w.errors += bool(r.error)
        w.truncated += r.finish_reason == "length"

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
    ) -> dict[str, float]:
        elapsed = max(now - self.started, 1e-9)
        step_wall = max(now - self._last_step_at, 1e-9)
        self._last_step_at = now
        self.trained_tokens += report.tokens
        self.staleness_total.update(report.staleness)
        w, self._window = self._window, _Window()
        rec: dict[str, float] = {
            "step": float(len(self.records) + 1),
            "version": float(report.version),
            "time/elapsed_s": elapsed,
            "time/step_s": step_wall,
            "throughput/tokens_per_s": self.trained_tokens / elapsed,
            "throughput/step_tokens_per_s": report.tokens / step_wall,
            "train/tokens": float(report.tokens),
            "train/trajectories": float(report.trajectories),
            "trainer/wait_s": report.wait_s,
            "trainer/train_s": report.train_s,
            "trainer/push_wait_s": report.push_wait_s,
            "trainer/idle_ratio": report.wait_s / step_wall,
            "rollout/rewarded": float(len(w.rewards)),
            "rollout/reward_errors": float(w.errors),
            "rollout/truncated": float(w.truncated),
            "ps/version": float(ps_version),
            "coordinator/cycles": float(coordinator.cycles),
            "coordinator/discarded": float(coordinator.discarded),
            "coordinator/commands": float(coordinator.commands),
            "coordinator/decision_ms": coordinator.last_decision_s * 1e3,
        }
        if w.rewards:
            rec["rollout/reward_mean"] = sum(w.rewards) / len(w.rewards)
            rec["rollout/response_len_mean"] = sum(w.lengths) / len(w.lengths)
        total = sum(report.staleness.values())
        if total:
            rec["staleness/mean"] = sum(k * n for k, n in report.staleness.items()) / total
            rec["staleness/max"] = float(max(report.staleness))
        for k, n in sorted(report.staleness.items()):
            rec[f"staleness/hist/{k}"] = float(n)
        rec.update(_time_shares(instance_times, command_seconds, elapsed, len(self.instances)))
        for inst, t in instance_times.items():
            rec[f"rollout/idle_ratio/{inst}"] = t.idle_s / max(t.idle_s + t.busy_s, 1e-9)
        if instance_times:
            ratios = [rec[f"rollout/idle_ratio/{i}"] for i in instance_times]
            rec["rollout/idle_ratio"] = sum(ratios) / len(ratios)
        for inst, v in (instance_versions or {}).items():
            rec[f"rollout/version/{inst}"] = float(v)
        for key, value in report.metrics.items():
            rec.setdefault(key, float(value))
        self.records.append(rec)
        return rec


def _time_shares(
    times: Mapping[int, InstanceTimes],
    commands: Mapping[str, float],
    elapsed: float,
    instances: int,
) -> dict[str, float]:
    """Shares of all rollout instance-seconds so far (Table 3).

    Pull / Route / Interrupt count the time each command kept an instance from
    generating (fetching and loading weights; fetching routed trajectories from the TS
    and queueing them; stopping trajectories and returning them to the TS), as the
    instances measure it. The control plane's view of the same commands, which adds the
    RPC and the wait for the decode step in progress, is ``coordinator/latency_s/*``.
    """
    total = max(elapsed * max(instances, 1), 1e-9)
    held: dict[str, float] = {}
    for t in times.values():
        for kind, s in t.command_s.items():
            held[kind] = held.get(kind, 0.0) + s
    seconds = {
        "pull": held.get("pull", 0.0),
        "route": held.get("route", 0.0),
        "interrupt": held.get("interrupt", 0.0) + held.get("abort", 0.0),
        "prefill": sum(t.prefill_s for t in times.values()),
        "decode": sum(t.decode_s for t in times.values()),
    }
    out = {f"rollout/time_share/{k}": v / total for k, v in seconds.items()}
    out["rollout/time_share/commands"] = (
        seconds["pull"] + seconds["route"] + seconds["interrupt"]
    ) / total
    for kind, s in commands.items():
        out[f"coordinator/latency_s/{kind}"] = s
    return out
