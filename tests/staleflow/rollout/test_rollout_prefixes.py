"""What an instance tells of the KV it keeps between a trajectory's turns (the embedded
engine's prefix store): which trajectories' prefixes it holds (for routing their next
turn there), the reuse in its times and the step record, and that a Pull empties it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from staleflow.engines.base import FINISH_STOP  # noqa: E402
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from staleflow.rollout.instance import Finished, RolloutInstance  # noqa: E402
from staleflow.runtime.controller.metrics import _prefix_reuse  # noqa: E402
from tests.support.tiny_models import build_model  # noqa: E402
from trajectory_server.types import RoutedTrajectory  # noqa: E402

VOCAB = 48


def _engine(keep_trajs: int = 256) -> EmbeddedEngine:
    model = build_model(seed=0, tied=False, vocab=VOCAB)
    config = EmbeddedEngineConfig(
        kv_budget_tokens=512,
        max_running=4,
        max_seq_len=64,
        temperature=0.0,
        eos_token_id=tuple(range(0, VOCAB, 2)),  # half the vocabulary ends a turn
        prefix_cache_tokens=1024,
        prefix_cache_trajs=keep_trajs,
    )
    return EmbeddedEngine(model, config)


def _routed(traj_id: int, tokens: np.ndarray, mask: list[bool]) -> RoutedTrajectory:
    n = len(tokens)
    return RoutedTrajectory(
        traj_id,
        group_id=0,
        v_traj=0,
        sample_id=0,
        answer="",
        prompt=np.arange(1, 7, dtype=np.int32),
        tokens=tokens.astype(np.int32),
        logprobs=np.zeros(n, np.float32),
        versions=np.zeros(n, np.int32),
        mask=np.array(mask, bool),
    )


def _instance(
    engine: EmbeddedEngine,
) -> tuple[RolloutInstance, list[Finished], threading.Semaphore]:
    """A started instance, the turns it finished and a semaphore released per turn."""
    got: list[Finished] = []
    arrived = threading.Semaphore(0)

    def on_finished(fs: list[Finished]) -> None:
        got.extend(fs)
        for _ in fs:
            arrived.release()

    instance = RolloutInstance(0, engine, max_response=24, on_finished=on_finished)
    instance.start()
    return instance, got, arrived


def test_an_instance_lists_held_prefixes_counts_reuse_and_a_pull_empties_it() -> None:
    engine = _engine()
    instance, got, arrived = _instance(engine)
    try:
        instance.submit([_routed(7, np.zeros(0), [])])
        assert arrived.acquire(timeout=10)
        first = got[-1].task
        assert first.finish_reason == FINISH_STOP, "the greedy turn did not stop"
        assert instance.held_prefixes() == (7,)
        # the next turn: the first turn, then a three-token observation (mask False)
        tokens = np.concatenate([first.tokens, [3, 5, 9]])
        mask = [*first.mask.tolist(), False, False, False]  # type: ignore[union-attr]
        instance.submit([_routed(7, tokens, mask)])
        assert arrived.acquire(timeout=10)
        second = got[-1].task
        assert second.mask[: len(mask)].tolist() == mask  # type: ignore[index]
        times = instance.times()
        assert times.prefix_hits == 1
        assert times.prefix_tokens == 6 + len(first.tokens) - 1  # all but the stop token
        assert _prefix_reuse({0: times}) == {
            "rollout/prefix_hits": 1.0,
            "rollout/prefix_tokens_saved": float(times.prefix_tokens),
        }
        if second.finish_reason == FINISH_STOP:
            assert instance.held_prefixes() == (7,)
            weights = {n: p.detach().numpy().copy() for n, p in engine._model.named_parameters()}
            instance.load_weights(weights, 1)
            assert instance.held_prefixes() == ()  # computed by the old weights
        assert instance.drop_prefixes([7]) == []
    finally:
        instance.stop()


def test_the_snapshot_lists_what_the_engine_keeps_evictions_and_drops_included() -> None:
    """What the coordinator's KV locality reads (``InstanceSnapshot.held``): the engine's
    own list with the tokens each prefix keeps, marked exact, so an evicted prefix is not
    routed to (the control plane's assumption would have kept it until a Pull)."""
    instance, got, arrived = _instance(_engine(keep_trajs=1))  # one trajectory's room
    try:
        assert instance.snapshot().held == () and instance.snapshot().held_exact
        instance.submit([_routed(7, np.zeros(0), [])])
        assert arrived.acquire(timeout=10)
        first = got[-1].task
        assert first.finish_reason == FINISH_STOP, "the greedy turn did not stop"
        kept = 6 + len(first.tokens) - 1  # the prompt and the turn but its stop token
        assert instance.snapshot().held == ((7, kept),)
        instance.submit([_routed(8, np.zeros(0), [])])  # its turn evicts 7's prefix
        assert arrived.acquire(timeout=10)
        assert instance.snapshot().held == ((8, kept),)
        assert instance.drop_prefixes([8, 7]) == [8]  # its episode ended
        assert instance.snapshot().held == ()
    finally:
        instance.stop()


def test_no_reuse_leaves_the_step_record_as_it_was() -> None:
    from staleflow.rollout.instance import InstanceTimes

    idle = InstanceTimes(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0)
    assert _prefix_reuse({0: idle, 1: idle}) == {}
