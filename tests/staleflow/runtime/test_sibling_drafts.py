"""Grouped drafts across instances, the TS as the draft server: two embedded engines (two
instance hosts) on one TS in process, a group split across them. Instance B, handed the
response of the member that ran on A, drafts from it; without the fetch it cannot. The
instances' times carry their engines' speculation counters (the step record's source)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from staleflow.engines.drafts import DraftSettings, SpeculationSettings  # noqa: E402
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from staleflow.rollout.instance import Finished  # noqa: E402
from staleflow.runtime.workers.instance_host import InstanceHost  # noqa: E402
from tests.support.tiny_models import build_model  # noqa: E402
from trajectory_server import TrajectoryServer, TrajectoryServerConfig  # noqa: E402

VOCAB = 64
# short enough that the greedy response has no n-gram twice: own history drafts nothing
RESPONSE = 8


class _Prompts:
    """Prompt ``i``: eight tokens of its own."""

    def __init__(self) -> None:
        self.drawn = 0

    def next_sample(self) -> object:
        i, self.drawn = self.drawn, self.drawn + 1
        prompt = (np.arange(8, dtype=np.int32) * 7 + 5 * i) % (VOCAB - 1) + 1
        return type("Sample", (), {"sample_id": i, "prompt_ids": prompt, "answer": ""})()


def _engine(method: str | None) -> EmbeddedEngine:
    # the same weights on both instances (seeded)
    model = build_model(seed=0, tied=False, vocab=VOCAB)
    spec = None
    if method is not None:
        drafts = DraftSettings(scope=method, min_ngram=3, max_ngram=4)
        spec = SpeculationSettings(drafts=drafts, max_draft=8)
    config = EmbeddedEngineConfig(
        kv_budget_tokens=512,
        max_running=4,
        max_seq_len=64,
        temperature=0.0,  # greedy: B's member samples exactly what A's did
        eos_token_id=(),
        speculation=spec,
    )
    return EmbeddedEngine(model, config)


class _OwnWeights:
    """A Pull that hands the engine its own weights back (version 0)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self._engine = engine

    def fetch(self, at_least: int) -> tuple[int, dict[str, np.ndarray]]:
        params = self._engine._model.named_parameters()
        return 0, {n: p.detach().numpy().copy() for n, p in params}


class _Host:
    """An instance host whose finished trajectories the test collects."""

    def __init__(self, inst: int, ts: TrajectoryServer, method: str | None) -> None:
        self.finished: list[Finished] = []
        self._arrived = threading.Semaphore(0)
        self.engine = _engine(method)
        self.host = InstanceHost(
            inst,
            self.engine,
            ts=ts,
            weights=_OwnWeights(self.engine),  # type: ignore[arg-type]
            max_response=RESPONSE,
            on_finished=self._on_finished,
            on_copy_finished=lambda done: (),  # race copies: none finishes in these tests
        )

    def _on_finished(self, fs: list[Finished]) -> None:
        self.finished.extend(fs)
        for _ in fs:
            self._arrived.release()

    def run(self, ts: TrajectoryServer, traj_id: int, fetch: bool) -> Finished:
        """Route ``traj_id`` here, hand the engine its siblings (``fetch``), then generate
        it to its end (the generation thread starts after the fetch: nothing races it)."""
        assert self.host.route([traj_id], {traj_id: 0}) == (traj_id,)
        if fetch:
            self.host.fetch_siblings()
        self.host.instance.start()
        try:
            assert self._arrived.acquire(timeout=60), f"trajectory {traj_id} did not finish"
        finally:
            self.host.stop()
        done = self.finished[-1]
        t = done.task
        ts.complete(traj_id, t.tokens, t.logprobs, t.versions, 0.0, t.finish_reason)
        assert len(t.tokens) == RESPONSE
        return done


def _split_group(fetch: bool, method: str = "group") -> tuple[_Host, Finished, Finished]:
    ts = TrajectoryServer(TrajectoryServerConfig(eta=1, batch_size=1, group_size=2), _Prompts())
    assert ts.group_members(0) == (0, 1)
    a, b = _Host(0, ts, method), _Host(1, ts, method)
    first = a.run(ts, 0, fetch)
    second = b.run(ts, 1, fetch)
    return b, first, second


def test_a_sibling_on_another_instance_drafts_for_the_group() -> None:
    b, first, second = _split_group(fetch=True)
    # greedy: the same prompt gives the same response on both instances
    np.testing.assert_array_equal(first.task.tokens, second.task.tokens)
    assert b.host.siblings is not None and b.host.siblings.tokens == RESPONSE
    with_siblings = b.host.times().speculation
    # the prefill samples the first token; the next step drafts the rest of the sibling's
    # response (but one token: the step adds one of its own) and accepts all of it
    assert with_siblings is not None
    assert with_siblings.accepted == with_siblings.drafted == RESPONSE - 2
    b_alone, _, alone = _split_group(fetch=False)
    np.testing.assert_array_equal(alone.task.tokens, second.task.tokens)
    without = b_alone.host.times().speculation
    assert without is not None and without.accepted == 0, "own history drafted: shorten RESPONSE"
    assert b_alone.host.siblings is not None and b_alone.host.siblings.fetches == 0


def test_the_groups_that_left_the_ts_are_forgotten_and_off_means_no_fetch() -> None:
    ts = TrajectoryServer(TrajectoryServerConfig(eta=1, batch_size=1, group_size=2), _Prompts())
    a, b = _Host(0, ts, "group"), _Host(1, ts, "group")
    a.run(ts, 0, fetch=False)
    b.host.route([1], {1: 0})
    assert b.host.fetch_siblings() == RESPONSE and b.host.siblings.groups == 1  # type: ignore[union-attr]
    assert b.engine._spec.source.groups == 1  # type: ignore[union-attr]  # the engine's own
    assert b.host.fetch_siblings() == 0  # nothing new: nothing travels
    assert b.host.abort([1]) == (1,)
    ts.abort_group(0)
    assert b.host.fetch_siblings() == 0
    assert b.host.siblings.groups == 0 and b.engine._spec.source.groups == 0  # type: ignore[union-attr]
    # the progress thread fetches after each report (what a fetch hands over is above)
    c = _Host(3, ts, "group")
    c.host.start(progress_every_s=0.01)
    try:
        deadline = time.monotonic() + 30
        while c.host.siblings.fetches < 2 and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.01)
        assert c.host.siblings.fetches >= 2  # type: ignore[union-attr]
    finally:
        c.host.stop()
    # own-history drafts and no speculation: no sibling is fetched, and no counters
    for method in ("own", None):
        host = _Host(2, ts, method).host
        assert (host.siblings is None) == (method is None) and host.fetch_siblings() == 0
        assert (host.times().speculation is None) == (method is None)


def test_an_own_history_instance_fetches_siblings_for_a_copy_drafting_from_the_group() -> None:
    """A race copy drafting from its group (rollout.speculation.race_method) on an instance
    whose engine drafts from own history: the copy reaches the engine with its method, the
    fetch runs while it is there, and the copy drafts from its sibling's response."""
    ts = TrajectoryServer(TrajectoryServerConfig(eta=1, batch_size=1, group_size=2), _Prompts())
    a, b = _Host(0, ts, "group"), _Host(1, ts, "own")
    assert a.host.route([0, 1], {0: 0, 1: 0}) == (0, 1)
    sibling = (np.arange(RESPONSE, dtype=np.int32) * 5 + 3) % (VOCAB - 1) + 1
    zeros = np.zeros(RESPONSE, np.float32)
    ts.complete(0, sibling, zeros, zeros.astype(np.int32), 0.0, "length")
    assert b.host.fetch_siblings() == 0  # nothing here drafts from a group
    assert b.host.race(1, a.host.holder, "group") == 0  # a copy of 1 from its start
    assert b.host.fetch_siblings() == RESPONSE
    source = b.engine._spec.source  # type: ignore[union-attr]
    source.extend(1, sibling[:1])  # once the copy sampled its first token...
    assert source.draft(1, 4) == sibling[1:5].tolist()  # ...it drafts the sibling's next
