"""KV reuse across turns on the embedded engine (``engines/embedded/prefix_store.py``): a
trajectory's next turn, back on the instance that ran its previous one, prefills only
what is new, and is generated exactly as with a full re-prefill."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from staleflow.engines.base import FINISH_STOP, EngineOutput, GenerationRequest  # noqa: E402
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402
from staleflow.engines.embedded.prefix_store import (  # noqa: E402
    HeldPrefix,
    PrefixStore,
    common_prefix,
)
from staleflow.engines.embedded.runner import ModelRunner  # noqa: E402

VOCAB = 48
STOPS = tuple(range(0, VOCAB, 3))  # a third of the vocabulary ends a turn: turns are short
TOL = 2e-5


def engine(model, *, keep: int, temperature: float = 0.0, **overrides) -> EmbeddedEngine:
    cfg = dict(
        kv_budget_tokens=1024,
        max_running=8,
        max_seq_len=120,
        temperature=temperature,
        eos_token_id=STOPS,
        seed=3,
        prefix_cache_tokens=keep,
    )
    cfg.update(overrides)
    return EmbeddedEngine(model, EmbeddedEngineConfig(**cfg))


def drain(eng: EmbeddedEngine) -> dict[int, EngineOutput]:
    done: dict[int, EngineOutput] = {}
    for _ in range(1000):
        if not eng.has_work:
            return done
        done.update({o.traj_id: o for o in eng.step()})
    raise AssertionError("engine did not drain")


def observation(traj_id: int, turn: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * traj_id + turn)
    return rng.integers(1, VOCAB, size=3 + traj_id % 4).astype(np.int32)


def play(eng: EmbeddedEngine, ids: list[int], turns: int) -> dict[int, EngineOutput]:
    """``turns`` turns of each trajectory, submitted together; after a turn that ended at
    its stop token, an observation (logprob 0, the last token's version) and the next."""
    prompts = {
        t: np.random.default_rng(t).integers(0, VOCAB, 4 + 2 * t).astype(np.int32) for t in ids
    }
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    state = {t: (e_i, e_f, e_i) for t in ids}
    live = list(ids)
    last: dict[int, EngineOutput] = {}
    for turn in range(turns):
        eng.submit(
            [GenerationRequest(t, prompts[t], *state[t], len(state[t][0]) + 8) for t in live]
        )
        done = drain(eng)
        last.update(done)
        live = [t for t in live if done[t].finish_reason == FINISH_STOP]
        for t in live:
            o, obs = done[t], observation(t, turn)
            state[t] = (
                np.concatenate([o.tokens, obs]),
                np.concatenate([o.logprobs, np.zeros(len(obs), np.float32)]),
                np.concatenate([o.versions, np.full(len(obs), o.versions[-1], np.int32)]),
            )
    return last


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "keyed-samples"])
def test_a_next_turn_on_kept_kv_is_the_turn_a_full_reprefill_generates(
    make_model, temperature: float
) -> None:
    ids = list(range(1, 9))
    reuse = engine(make_model(), keep=4096, temperature=temperature)
    again = engine(make_model(), keep=0, temperature=temperature)
    with_kv, without = play(reuse, ids, 3), play(again, ids, 3)
    for t in ids:
        assert with_kv[t].tokens.tolist() == without[t].tokens.tolist(), f"trajectory {t}"
        np.testing.assert_allclose(with_kv[t].logprobs, without[t].logprobs, atol=TOL, rtol=0)
        assert with_kv[t].versions.tolist() == without[t].versions.tolist()
    times, plain = reuse.times(), again.times()
    multi = [t for t in ids if len(with_kv[t].tokens) > 8]  # took a second turn at least
    assert multi, "no trajectory reached a second turn: the test proves nothing"
    assert times.prefix_hits >= len(multi)
    # every reused token is one not prefilled
    assert times.prefill_tokens + times.prefix_tokens == plain.prefill_tokens
    assert times.prefix_tokens > 0 and plain.prefix_hits == plain.prefix_tokens == 0


def test_the_kept_prefix_is_all_but_the_stop_token_and_is_listed(make_model) -> None:
    eng = engine(make_model(), keep=4096)
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    for seed in range(20):  # the first prompt whose turn ends at a stop token
        prompt = np.random.default_rng(seed).integers(0, VOCAB, 8).astype(np.int32)
        eng.submit([GenerationRequest(5, prompt, e_i, e_f, e_i, 8)])
        out = drain(eng)[5]
        if out.finish_reason == FINISH_STOP:
            break
        assert eng.held_prefixes() == ()  # a turn cut at its length keeps nothing
    else:
        pytest.fail("no turn stopped")
    assert eng.held_prefixes() == (5,)
    obs = observation(5, 0)
    tokens = np.concatenate([out.tokens, obs])
    eng.submit(
        [
            GenerationRequest(
                5,
                prompt,
                tokens,
                np.concatenate([out.logprobs, np.zeros(len(obs), np.float32)]),
                np.zeros(len(tokens), np.int32),
                len(tokens) + 4,
            )
        ]
    )
    assert eng.held_prefixes() == (5,)  # taken at admission, not at submission
    before = eng.times()
    eng.step()
    assert eng.held_prefixes() == ()
    after = eng.times()
    # the turn's prompt and tokens but its stop token were kept; the stop token and the
    # observation but its last token (the next decode input) were prefilled
    assert after.prefix_tokens - before.prefix_tokens == len(prompt) + len(out.tokens) - 1
    assert after.prefill_tokens - before.prefill_tokens == len(obs)


def test_a_weight_load_drops_every_kept_prefix_and_the_next_turn_reprefills(
    make_model,
) -> None:
    ids = list(range(1, 9))
    reuse, plain = engine(make_model(), keep=4096), engine(make_model(), keep=0)
    play(reuse, ids, 1)
    assert reuse.held_prefixes(), "no turn stopped"
    other = make_model(seed=5)
    weights = {n: p.detach().numpy().copy() for n, p in other.named_parameters()}
    reuse.load_weights(weights, 1)
    assert reuse.held_prefixes() == ()
    hits = reuse.times().prefix_hits
    # the next turns run under the new weights exactly as a fresh engine of them runs them
    plain.load_weights(weights, 1)
    prompt = np.random.default_rng(2).integers(0, VOCAB, 8).astype(np.int32)
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    for eng in (reuse, plain):
        eng.submit([GenerationRequest(2, prompt, e_i, e_f, e_i, 8)])
    a, b = drain(reuse)[2], drain(plain)[2]
    assert a.tokens.tolist() == b.tokens.tolist()
    assert reuse.times().prefix_hits == hits


def test_abort_and_drop_forget_a_kept_prefix(make_model) -> None:
    eng = engine(make_model(), keep=4096)
    play(eng, list(range(1, 9)), 1)
    held = eng.held_prefixes()
    assert len(held) >= 2, "fewer than two turns stopped"
    assert eng.abort([held[0]]) == []  # not running: nothing returned, the prefix dropped
    assert eng.drop_prefixes([held[1], 999]) == [held[1]]
    assert eng.held_prefixes() == held[2:]


def test_the_store_is_bounded_and_evicts_the_least_recent() -> None:
    def prefix(n: int) -> HeldPrefix:
        t = torch.zeros(1, n, 2)
        return HeldPrefix(np.arange(n, dtype=np.int32), [t], [t])

    store = PrefixStore(max_tokens=10, max_trajs=3)
    assert store.put(1, prefix(4)) and store.put(2, prefix(4))
    assert store.put(3, prefix(4))  # 12 tokens > 10: 1 goes
    assert store.held() == (2, 3) and store.tokens == 8
    assert store.put(4, prefix(1)) and store.put(5, prefix(1))  # 3 trajectories at most
    assert store.held() == (3, 4, 5) and store.evictions == 2
    assert not store.put(6, prefix(11))  # larger than the store: not kept, nothing evicted
    assert store.held() == (3, 4, 5)
    assert store.take(4) is not None and store.take(4) is None
    assert store.tokens == 5
    store.clear()
    assert store.held() == () and store.tokens == 0


def test_engine_store_bounds_apply(make_model) -> None:
    eng = engine(make_model(), keep=4096, prefix_cache_trajs=2)
    play(eng, list(range(1, 9)), 1)
    assert len(eng.held_prefixes()) <= 2


def test_common_prefix() -> None:
    a = np.array([1, 2, 3, 4], np.int32)
    assert common_prefix(a, np.array([1, 2, 3, 4, 5], np.int32)) == 4
    assert common_prefix(a, np.array([1, 2, 9], np.int32)) == 2
    assert common_prefix(a, np.array([7], np.int32)) == 0
    assert common_prefix(a, np.zeros(0, np.int32)) == 0


def test_extend_computes_what_a_whole_prefill_does(make_model) -> None:
    """Two rows with different held lengths, extended in one padded batch: their new
    positions' K/V and logits are those of one prefill of the whole sequence."""
    runner = ModelRunner(make_model())
    cache = runner.new_cache(4, 64)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, VOCAB, 20), rng.integers(0, VOCAB, 13)]
    starts = [12, 5]
    whole = []
    for row, seq in enumerate(seqs):
        ids = torch.tensor(seq, dtype=torch.long)[None]
        whole.append(
            runner.prefill(
                cache, ids, torch.tensor([len(seq)]), torch.tensor([row]), want_logits=True
            )[0]
        )
        # rows 2 and 3 hold only the first `start` positions
        head = ids[:, : starts[row]]
        runner.prefill(cache, head, torch.tensor([starts[row]]), torch.tensor([row + 2]))
    tails = [s[st:] for s, st in zip(seqs, starts, strict=True)]
    longest = max(len(t) for t in tails)
    ids = torch.zeros(2, longest, dtype=torch.long)
    for j, t in enumerate(tails):
        ids[j, : len(t)] = torch.tensor(t)
    logits = runner.extend(
        cache,
        ids,
        torch.tensor(starts),
        torch.tensor([len(t) for t in tails]),
        torch.tensor([2, 3]),
        want_logits=True,
    )
    for j, (seq, st) in enumerate(zip(seqs, starts, strict=True)):
        n = len(seq)
        torch.testing.assert_close(logits[j, : n - st], whole[j][st:n], atol=1e-5, rtol=0)
        for layer in range(len(cache.k)):
            torch.testing.assert_close(
                cache.k[layer][2 + j, :, :n], cache.k[layer][j, :, :n], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                cache.v[layer][2 + j, :, :n], cache.v[layer][j, :, :n], atol=1e-5, rtol=0
            )


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        EmbeddedEngineConfig(kv_budget_tokens=64, max_seq_len=64, prefix_cache_tokens=-1)
