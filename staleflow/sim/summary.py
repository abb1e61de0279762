"""What a simulated run reports."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from coordinator.seer import ProbeAccuracy
from staleflow.runfolder.run_summary import SIM_JSON_KEYS, RunFigures

if TYPE_CHECKING:
    from collections.abc import Mapping

    from coordinator import Coordinator
    from coordinator.cycle import Decision
    from staleflow.sim.engine import InstanceTimes, SimInstance
    from staleflow.sim.planes import SimPlanes
    from staleflow.sim.race import SimRaces
    from staleflow.sim.trainer import SimTrainer
    from staleness import ConsumedBatch, StalenessManager


class _Named(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def eta(self) -> int: ...


class SimulatedRun(Protocol):
    """What :func:`summarise` reads of a simulation: a
    :class:`~staleflow.sim.cluster.SimCluster` once it has run (typed here, so that the
    summary does not import the cluster that returns it)."""

    @property
    def config(self) -> _Named: ...
    @property
    def trainer(self) -> SimTrainer: ...
    @property
    def now(self) -> float: ...
    @property
    def batches(self) -> list[ConsumedBatch]: ...
    @property
    def instances(self) -> Mapping[int, SimInstance]: ...
    @property
    def response_lengths(self) -> list[int]: ...
    @property
    def coordinator(self) -> Coordinator: ...
    @property
    def manager(self) -> StalenessManager: ...
    @property
    def planes(self) -> SimPlanes: ...
    @property
    def races(self) -> SimRaces | None: ...
    @property
    def stalled(self) -> bool: ...
    @property
    def late_wasted_tokens(self) -> int: ...
    @property
    def tail_s(self) -> list[float]: ...
    @property
    def ready_wait(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Summary(RunFigures[float, dict[int, int]]):
    """What a simulated run reports; ``steps``, ``tokens_per_s``, ``trainer_idle_ratio``,
    ``rollout_idle_ratio``, ``elapsed_s`` and ``staleness_hist`` are the figures a real
    launch's summary has under the same names
    (:class:`staleflow.runfolder.run_summary.RunFigures`, the base of both); the JSON of
    :meth:`as_dict` keeps ``elapsed_s`` under its old key ``seconds``.

    Throughput is the paper's (§6.1): tokens (prompt + response) of the trajectories
    consumed by training, divided by the time until the last counted step ended.

    ``staleness``: consumed groups per staleness ``V_buf - V_group``, over every batch
    (``staleness_hist`` counts their trajectories, as a launch's summary does).
    ``steady_tokens_per_s``: the same after the warm-up, i.e. over the steps after the
    first ``eta + 1`` (whose buffers all hold version-0 data, shortest groups first);
    0.0 when the run has no step after the warm-up.
    ``max_staleness_per_batch``: one entry per consumed batch.
    Idle ratios are shares of the run's virtual time; ``trainer_idle_ratio`` is
    RolloutPipe's "trainer waiting ratio" (its §5.1: wait / (wait + compute), the trainer
    computing while it runs a step's forward, backward and overhead or streams groups).
    ``rampup_s``: when the step that ends the warm-up (step ``eta + 1``) ended.
    ``trainer_busy_steady``: share of the steady span (after the warm-up) the trainer
    spent training; near 1 the run is trainer-bound there, lower the trainer waited for
    buffers (rollout- or tail-bound).
    ``estimate_error``: mean over instance-periods of |estimated - actual| / actual
    throughput, the estimate being the coordinator's cost model (Appendix B.2 reports
    10.52% for its real cluster).
    """

    name: str
    eta: int
    tokens: int
    steady_tokens_per_s: float
    staleness: dict[int, int]
    max_staleness_per_batch: tuple[int, ...]
    rollout_prefill_ratio: float
    rollout_pull_ratio: float
    mean_response_len: float
    preemptions: int
    commands: dict[str, int]
    cycles: int
    discarded_snapshots: int
    stalled: bool  # stopped early: no training step for ``stall_timeout_s``
    rampup_s: float = 0.0
    trainer_busy_steady: float = 0.0
    estimate_error: float = 0.0
    # Seer (coordinator/seer.py) and the tail: chunks returned to the TS and re-placed;
    # prefix tokens prefilled again (resumed partials, preemptions); response tokens of
    # trajectories aborted; mean over consumed batches of the seconds from their 90th
    # percentile finish to their last; probe accuracy (groups with >= 2 finished members,
    # mean shortfall of the first finished length against the group's longest).
    chunks: int = 0
    reprefill_tokens: int = 0
    wasted_tokens: int = 0
    tail_s: float = 0.0
    # mean over the counted steps of the trainer steps finished between the moment the
    # step's batch was complete (its last trajectory rewarded) and its Consume: the
    # staleness a batch gathers waiting for the trainer once generated, the part the
    # freshness rule (coordinator/freshness.py) can take off; 1 where a batch completes
    # while the trainer trains on the one before
    ready_wait_versions: float = 0.0
    probe_groups: int = 0
    probe_error: float = 0.0
    # RolloutPipe's complete-group pipelining (``ClusterConfig.stream_training``): groups
    # and tokens the trainer trained on before their buffer was Ready (0 when off).
    # ``rollout_to_train_end_s``: mean over steps of the seconds from the moment the
    # oldest version the step's buffer may hold (``V_buf - eta``) reached the PS to the
    # step's end. At eta = 0 that version is the buffer's own and no trajectory of it
    # can start earlier, so this is RolloutPipe's rollout-to-train-end (its Pull
    # included); at eta >= 1 it spans the staleness window, an upper bound.
    # ``train_wait_ratio``: RolloutPipe's Eq. 4 averaged over steps, (first work on the
    # step's groups - that start) / (step end - that start).
    streamed_groups: int = 0
    streamed_tokens: int = 0
    rollout_to_train_end_s: float = 0.0
    train_wait_ratio: float = 0.0
    # SpecActor's tail race (coordinator.race; sim/race.py): copies started, trajectories
    # a copy completed first, and the losers' tokens after the fork (not in wasted_tokens).
    races_started: int = 0
    races_won: int = 0
    race_wasted_tokens: int = 0
    # dynamic sampling (``ClusterConfig.filtered_share``): groups filtered out, and their
    # share of the groups filtered or consumed by the counted steps (0 when off)
    filtered_groups: int = 0
    filtered_frac: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """The simulator's JSON: the fields by name, a shared figure under its old key
        (``SIM_JSON_KEYS``), histograms keyed by strings."""
        out = {SIM_JSON_KEYS.get(k, k): v for k, v in asdict(self).items()}
        out["staleness"] = {str(k): v for k, v in self.staleness.items()}
        out["staleness_hist"] = {str(k): v for k, v in self.staleness_hist.items()}
        out["max_staleness_per_batch"] = list(self.max_staleness_per_batch)
        return out


def summarise(cluster: SimulatedRun) -> Summary:
    trainer = cluster.trainer
    end = trainer.step_ends[-1] if trainer.step_ends else cluster.now
    end = max(end, 1e-9)
    hist: Counter[int] = Counter()
    trajs: Counter[int] = Counter()  # the same per trajectory, as a launch counts it
    per_batch = []
    for b in cluster.batches[: trainer.steps]:
        hist.update(b.staleness)
        for g in b.groups:
            trajs[g.staleness(b.version)] += len(g.trajectories)
        per_batch.append(max(b.staleness, default=0))
    times = [i.times for i in cluster.instances.values()]
    span = max(cluster.now, 1e-9) * len(times)
    counted = sum(len(g.trajectories) for b in cluster.batches[: trainer.steps] for g in b.groups)
    responses = cluster.response_lengths[:counted]
    seer = cluster.coordinator.strategies.seer
    probes = seer.accuracy() if seer is not None else ProbeAccuracy()
    return Summary(
        name=cluster.config.name,
        eta=cluster.config.eta,
        steps=trainer.steps,
        elapsed_s=end,
        tokens=trainer.tokens,
        tokens_per_s=trainer.tokens / end,
        steady_tokens_per_s=_steady(cluster),
        staleness=dict(sorted(hist.items())),
        staleness_hist=dict(sorted(trajs.items())),
        max_staleness_per_batch=tuple(per_batch),
        rollout_idle_ratio=sum(t.idle for t in times) / span,
        rollout_prefill_ratio=sum(t.prefill for t in times) / span,
        rollout_pull_ratio=sum(t.pull for t in times) / span,
        trainer_idle_ratio=1.0 - min(1.0, trainer.busy_time / end),
        mean_response_len=sum(responses) / len(responses) if responses else 0.0,
        preemptions=sum(t.preemptions for t in times),
        commands=dict(cluster.planes.commands),
        cycles=cluster.coordinator.stats.cycles,
        discarded_snapshots=cluster.coordinator.stats.discarded,
        stalled=cluster.stalled,
        rampup_s=_rampup(cluster),
        trainer_busy_steady=_busy_steady(cluster),
        estimate_error=_estimate_error(times),
        chunks=sum(t.chunks for t in times),
        reprefill_tokens=sum(t.reprefill_tokens for t in times),
        wasted_tokens=sum(t.wasted_tokens for t in times) + cluster.late_wasted_tokens,
        tail_s=_mean(cluster.tail_s[: trainer.steps]),
        ready_wait_versions=_mean(cluster.ready_wait[: trainer.steps]),
        probe_groups=probes.groups,
        probe_error=probes.mean_error,
        streamed_groups=sum(trainer.step_stream_groups),
        streamed_tokens=sum(trainer.step_stream_tokens),
        **_rollout_to_train_end(cluster),
        **_races(cluster),
        **_filtered(cluster),
    )


def _filtered(cluster: SimulatedRun) -> dict[str, Any]:
    filtered = cluster.manager.filtered_groups
    consumed = sum(len(b.groups) for b in cluster.batches[: cluster.trainer.steps])
    done = filtered + consumed
    return {"filtered_groups": filtered, "filtered_frac": filtered / done if done else 0.0}


def _races(cluster: SimulatedRun) -> dict[str, int]:
    r = cluster.races
    if r is None:
        return {}
    return {"races_started": r.started, "races_won": r.won, "race_wasted_tokens": r.wasted_tokens}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _steady(cluster: SimulatedRun) -> float:
    t, warm = cluster.trainer, cluster.config.eta + 1
    if len(t.step_ends) <= warm:
        return 0.0
    span = t.step_ends[-1] - t.step_ends[warm - 1]
    return sum(t.step_tokens[warm:]) / span if span > 0 else 0.0


def _rampup(cluster: SimulatedRun) -> float:
    ends, warm = cluster.trainer.step_ends, cluster.config.eta + 1
    if not ends:
        return cluster.now
    return ends[min(warm, len(ends)) - 1]


def _busy_steady(cluster: SimulatedRun) -> float:
    t, warm = cluster.trainer, cluster.config.eta + 1
    if len(t.step_ends) <= warm:
        return 0.0
    span = t.step_ends[-1] - t.step_ends[warm - 1]
    steps = zip(t.step_starts[warm:], t.step_ends[warm:], t.step_stream_s[warm:], strict=False)
    busy = sum(e - s + ahead for s, e, ahead in steps)
    return min(1.0, busy / span) if span > 0 else 0.0


def _rollout_to_train_end(cluster: SimulatedRun) -> dict[str, float]:
    t, eta = cluster.trainer, cluster.config.eta
    spans, waits = [], []
    for batch, first, end in zip(cluster.batches, t.step_firsts, t.step_ends, strict=False):
        v = batch.version - eta
        start = t.version_times[v - 1] if v > 0 else 0.0
        spans.append(end - start)
        waits.append((first - start) / (end - start) if end > start else 0.0)
    return {"rollout_to_train_end_s": _mean(spans), "train_wait_ratio": _mean(waits)}


def _estimate_error(times: list[InstanceTimes]) -> float:
    periods = sum(t.error_periods for t in times)
    return sum(t.error_sum for t in times) / periods if periods else 0.0


def staleness_per_buffer(cluster: SimulatedRun) -> list[tuple[int, dict[int, int]]]:
    """Figure 18: ``(V_buf, {staleness: groups})`` per consumed buffer, from the staleness
    manager's own record, limited to the steps the summary counts (the last Consume may
    have started a step that the run did not wait for)."""
    out = []
    for version, staleness in list(cluster.manager.history)[: cluster.trainer.steps]:
        out.append((version, dict(sorted(Counter(staleness).items()))))
    return out


def decision_figures(decisions: Sequence[Decision]) -> dict[str, float]:
    """The coordinator's decisions in a run (``SimCluster.decisions``): CPU ms per
    ``plan_cycle`` (median, p90, p99, max) and the mean size of what they decided over.
    Measured CPU time, so not in the deterministic :class:`Summary`; empty if none ran."""
    if not decisions:
        return {}
    ms = sorted(d.cpu_s * 1e3 for d in decisions)
    n = len(ms)

    def at(q: float) -> float:
        return ms[min(n - 1, int(q * (n - 1)))]

    return {
        "decisions": n,
        "decision_ms_median": statistics.median(ms),
        "decision_ms_p90": at(0.9),
        "decision_ms_p99": at(0.99),
        "decision_ms_max": ms[-1],
        "decision_instances": statistics.fmean(d.instances for d in decisions),
        "decision_on_instances": statistics.fmean(d.on_instances for d in decisions),
        "decision_waiting_on_tools": statistics.fmean(d.waiting_on_tools for d in decisions),
        "decision_routable": statistics.fmean(d.routable for d in decisions),
    }
