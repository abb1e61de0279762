"""RolloutPipe's complete-group pipelining in the simulator (``stream_training``): the idle
trainer trains on the occupied groups of its buffer before the buffer is Ready, and the
step at Consume pays only for the rest plus its overhead.

- by hand: with the real staleness manager and trainer, when each streamed piece starts
  and ends, and what the step after Ready costs;
- whole runs at eta 0, 1 and 3 keep the staleness bound and conserve trajectories, and
  every group streamed is one the TS hands over at the Consume, unchanged;
- at eta = 0 on skewed workloads it lowers the trainer's idle share, the mean step time
  and the rollout-to-train-end time against the same seed without it;
- off, nothing changes: every step pays for its whole batch, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from staleflow.sim import ClusterConfig, SimCluster, TrainerCosts, system, tiny
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.summary import summarise
from tests.staleflow.sim.test_sim_staleness_bound import assert_within_eta, run
from trajectory_server.types import TrainingBatch, TrainingGroup, TrainingTrajectory

# a = 0.01 s per token, c = 1e-4 s per squared length, b = 1 s: a group of one 100-token
# sequence costs 0.01 * 100 + 1e-4 * 100**2 = 2 s, one of 200 tokens 2 + 4 = 6 s.
COSTS = TrainerCosts(
    seconds_per_token=0.01, step_overhead_s=1.0, push_s=0.5, seconds_per_token_sq=1e-4
)
PROMPT = 20
RESPONSES = {1: 80, 2: 80, 3: 180}  # group id -> its one member's response length


class ScriptedTS:
    """Hands out groups of one trajectory (``RESPONSES``), recording what was read and
    taken; the staleness manager, trainer and event loop under test are the real ones."""

    def __init__(self) -> None:
        self.read: list[list[int]] = []
        self.taken: list[list[int]] = []

    def _batch(self, group_ids: Iterable[int], select: Mapping[int, Sequence[int]]) -> Any:
        groups = []
        for gid in group_ids:
            (tid,) = select[gid]
            tokens = np.zeros(RESPONSES[gid], np.int32)
            traj = TrainingTrajectory(tid, 0, tokens, tokens.astype(np.float32), tokens, 1.0, "")
            groups.append(TrainingGroup(gid, gid, "", np.zeros(PROMPT, np.int32), (traj,)))
        return TrainingBatch(tuple(groups))

    def read_batch(self, group_ids: list[int], select: Mapping[int, Sequence[int]]) -> Any:
        self.read.append(list(group_ids))
        return self._batch(group_ids, select)

    def take_batch(self, group_ids: list[int], select: Mapping[int, Sequence[int]]) -> Any:
        self.taken.append(list(group_ids))
        return self._batch(group_ids, select)


def _scripted(stream: bool) -> tuple[SimCluster, ScriptedTS]:
    """Groups 1, 2 and 3 (batch 3, group 1, eta 0) occupied at t = 0, 0.5 and 3."""
    config = tiny(eta=0, steps=1).with_(
        batch_size=3, group_size=1, trainer=COSTS, stream_training=stream
    )
    cluster = SimCluster(config)
    ts = ScriptedTS()
    cluster.ts = ts  # type: ignore[assignment]
    manager = cluster.manager
    for gid in RESPONSES:
        manager.reserve(gid, 10 * gid, 0)
    for t, gid in ((0.0, 1), (0.5, 2), (3.0, 3)):
        cluster._drain(t)
        manager.complete(gid, 10 * gid)
        cluster._maybe_train(t)
    cluster._drain(100.0)
    return cluster, ts


def test_streamed_work_starts_at_each_occupy_and_the_step_pays_only_the_rest() -> None:
    cluster, ts = _scripted(stream=True)
    trainer = cluster.trainer
    # t=0: group 1 occupied, the trainer idle: it streams group 1 until 2. Group 2 (0.5)
    # waits for that, then runs 2..4; group 3 makes the buffer Ready at 3 while group 2
    # runs, so the Consume comes at 4 and the step pays for group 3 and b: 6 + 1 = 7 s.
    assert ts.read == [[1], [2]]
    assert ts.taken == [[1, 2, 3]]  # all of them, the streamed ones too, at the Consume
    assert trainer.step_starts == [4.0] and trainer.step_ends == [11.0]
    assert trainer.step_firsts == [0.0]
    assert trainer.step_stream_groups == [2] and trainer.step_stream_tokens == [200]
    assert trainer.step_stream_s == [pytest.approx(4.0)]
    assert trainer.busy_time == pytest.approx(2.0 + 2.0 + 7.0)
    assert trainer.tokens == 400 and trainer.step_tokens == [400]
    assert trainer.version_times == [11.5] and trainer.ps_version == 1  # Push: 0.5 s
    s = summarise(cluster)
    assert (s.streamed_groups, s.streamed_tokens) == (2, 200)
    # rollout of buffer 0 started at 0 (version 0), training on it began at once
    assert s.rollout_to_train_end_s == pytest.approx(11.0) and s.train_wait_ratio == 0.0
    assert s.trainer_idle_ratio == pytest.approx(0.0)


def test_without_streaming_the_trainer_waits_for_the_ready_buffer() -> None:
    cluster, ts = _scripted(stream=False)
    trainer = cluster.trainer
    # Ready at 3, then the whole batch: 2 + 2 + 6 + 1 = 11 s.
    assert ts.read == [] and ts.taken == [[1, 2, 3]]
    assert trainer.step_starts == [3.0] and trainer.step_ends == [14.0]
    assert trainer.step_stream_groups == [0] and trainer.step_stream_s == [0.0]
    s = summarise(cluster)
    assert s.streamed_groups == 0 and s.rollout_to_train_end_s == pytest.approx(14.0)
    assert s.train_wait_ratio == pytest.approx(3.0 / 14.0)


def _stream(config: ClusterConfig) -> ClusterConfig:
    return config.with_(stream_training=True)


def _run_streamed(cluster: SimCluster) -> tuple[Any, list[tuple[int, set[int]]]]:
    """``run`` (bound and conservation), recording every group read before its Consume."""
    reads: list[tuple[int, set[int]]] = []  # (the trainer's buffer, trajectories read)
    read = cluster.ts.read_batch

    def recording(group_ids: list[int], select: Mapping[int, Sequence[int]]) -> Any:
        batch = read(group_ids, select)
        ids = {tr.traj_id for g in batch.groups for tr in g.trajectories}
        reads.append((cluster.manager.version, ids))
        return batch

    cluster.ts.read_batch = recording  # type: ignore[method-assign]
    return run(cluster), reads


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_the_bound_and_conservation_hold_with_streaming(eta: int) -> None:
    streamed = 0
    cases = [tiny(eta=eta, steps=4, seed=seed) for seed in range(3)]
    cases += [WORKLOADS["bimodal"].config(eta, steps=4, seed=0, small=True)]
    for base in cases:
        cluster = SimCluster(_stream(system("staleflow", base)))
        consumed, reads = _run_streamed(cluster)
        config, trainer = cluster.config, cluster.trainer
        assert_within_eta(consumed, config.eta, config.batch_size, config.group_size)
        # a group read ahead is taken, whole and unchanged, by that buffer's Consume
        taken = {b.version: {t for g in b.groups for t in g.trajectories} for b in cluster.batches}
        for version, ids in reads:
            assert ids <= taken.get(version, ids), (version, ids)
        # the group that makes a buffer Ready is never streamed
        assert all(n < config.batch_size for n in trainer.step_stream_groups)
        assert trainer.step_firsts == sorted(trainer.step_firsts)
        steps = zip(trainer.step_firsts, trainer.step_starts, trainer.step_ends, strict=False)
        assert all(first <= start < end for first, start, end in steps)
        streamed += sum(trainer.step_stream_groups)
    assert streamed > 0


@pytest.mark.parametrize("workload", ["bimodal", "hetero-0.2"])
def test_at_eta_zero_streaming_shortens_steps_and_idles_the_trainer_less(workload: str) -> None:
    for seed in range(2):
        base = system("staleflow", WORKLOADS[workload].config(0, steps=5, seed=seed, small=True))
        off = SimCluster(base).run()
        on = SimCluster(_stream(base)).run()
        assert on.steps == off.steps == 5 and not on.stalled
        assert on.streamed_groups > 0 and on.streamed_tokens > 0
        assert on.trainer_idle_ratio < off.trainer_idle_ratio, (seed, on, off)
        assert on.elapsed_s / on.steps < off.elapsed_s / off.steps, (seed, on, off)
        assert on.rollout_to_train_end_s < off.rollout_to_train_end_s
        assert on.train_wait_ratio < off.train_wait_ratio


def test_off_is_the_simulator_as_before() -> None:
    for eta, seed in itertools.product((0, 2), (0, 1)):
        base = tiny(eta=eta, steps=4, seed=seed)
        assert base.stream_training is False
        cluster = SimCluster(base)
        summary = cluster.run()
        assert SimCluster(base.with_(stream_training=False)).run() == summary
        assert SimCluster(_stream(base)).run() != summary  # the switch does something
        t, costs, n = cluster.trainer, base.trainer, base.batch_size
        assert summary.streamed_groups == summary.streamed_tokens == 0
        assert t.step_firsts == t.step_starts[: t.steps] and set(t.step_stream_s) == {0.0}
        # every step pays for its whole batch after the Consume, its update waiting for
        # the previous Push, exactly as before the switch existed
        push = 0.0
        for k in range(t.steps):
            lengths = [p + r for _, p, rs in cluster.trained[k * n : (k + 1) * n] for r in rs]
            work = costs.step_seconds(sum(lengths), sum(x * x for x in lengths))
            assert t.step_ends[k] == max(t.step_starts[k] + work, push)
            assert t.step_tokens[k] == sum(lengths)
            push = t.step_ends[k] + costs.push_s


def test_the_stream_suffix_turns_streaming_on_for_any_disaggregated_system() -> None:
    """``<system>+stream`` is that system with streamed training on, whatever else it is
    (``+fresh`` composes either way); sync, which alternates rollout and training on the
    same GPUs, has no idle trainer to stream into and is refused with the reason."""
    base = tiny(eta=2, steps=4, seed=0)
    for name in ("staleflow", "sticky", "staleflow+fresh"):
        plain, streamed = system(name, base), system(f"{name}+stream", base)
        assert not plain.stream_training and streamed.stream_training
        assert streamed.name == f"{name}+stream"
        assert streamed.with_(stream_training=False, name=name) == plain
    both = system("staleflow+stream+fresh", base)
    assert both.stream_training and both.coordinator.freshness.enabled
    assert SimCluster(system("sticky+stream", base)).run().streamed_groups > 0
    for name in ("sync+stream", "sync+fresh+stream"):
        with pytest.raises(ValueError, match="sync colocates rollout and training"):
            system(name, base)
