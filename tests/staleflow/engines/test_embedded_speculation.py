"""Speculative decoding in the embedded engine is lossless: greedy decoding is token-identical
with drafts and without, at temperature 1 the sampled tokens follow the target's
distribution (and, with the same keys, are the very tokens sampled without drafts), and the
recorded logprobs are a plain forward pass's."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from staleflow.engines.base import EngineOutput, GenerationRequest  # noqa: E402
from staleflow.engines.drafts import DraftSettings, SpeculationSettings  # noqa: E402
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402

from .conftest import VOCAB, build_model  # noqa: E402

PROMPT = np.array([3, 17, 5, 22, 9, 30], dtype=np.int32)
EMPTY_I, EMPTY_F = np.zeros(0, np.int32), np.zeros(0, np.float32)


def peaked_model(scale: float = 4.0) -> torch.nn.Module:
    """A tiny random Qwen2 whose next-token distributions are peaked (the final norm scaled),
    so that siblings share tokens and drafts are accepted often, and rejected often."""
    model = build_model()
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    return model


def engine(model, spec: SpeculationSettings | None, **overrides) -> EmbeddedEngine:
    cfg = dict(kv_budget_tokens=4096, max_running=64, max_seq_len=64, temperature=0.0, seed=0)
    cfg.update(overrides)
    return EmbeddedEngine(model, EmbeddedEngineConfig(speculation=spec, **cfg))


def spec(scope: str = "group", **kw) -> SpeculationSettings:
    return SpeculationSettings(drafts=DraftSettings(scope=scope, min_ngram=1, max_ngram=4), **kw)


def req(traj_id: int, max_response: int, group: int | None = 0, prompt=PROMPT) -> GenerationRequest:
    return GenerationRequest(traj_id, prompt, EMPTY_I, EMPTY_F, EMPTY_I, max_response, group)


def run(eng: EmbeddedEngine, waves: list[list[GenerationRequest]]) -> dict[int, EngineOutput]:
    """Each wave is submitted when the one before has drained, so later waves draft from
    earlier ones' responses."""
    done: dict[int, EngineOutput] = {}
    for wave in waves:
        eng.submit(wave)
        while eng.has_work:
            for out in eng.step():
                done[out.traj_id] = out
            assert eng.state().kv_tokens <= eng.config.kv_budget_tokens
    return done


def reference_logprobs(model, prompt: np.ndarray, tokens: np.ndarray, t: float) -> np.ndarray:
    seq = torch.tensor(np.concatenate([prompt, tokens]), dtype=torch.long)[None]
    with torch.inference_mode():
        logits = model(seq).logits[0].float()
    logits = logits[len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits if t == 0 else logits / t, -1)
    return logp[torch.arange(len(tokens)), torch.as_tensor(tokens, dtype=torch.long)].numpy()


def test_greedy_is_token_identical_and_drafts_are_accepted() -> None:
    model = peaked_model()
    prompts = [np.roll(PROMPT, i) for i in range(3)]
    waves = [
        [req(10 * g + m, 24, g, prompts[g]) for g in range(3) for m in range(w, w + 2)]
        for w in (0, 2)
    ]
    plain = run(engine(model, None), waves)
    for scope in ("group", "own"):
        eng = engine(model, spec(scope))
        got = run(eng, waves)
        assert sorted(got) == sorted(plain)
        for tid, out in plain.items():
            np.testing.assert_array_equal(got[tid].tokens, out.tokens)
            np.testing.assert_allclose(got[tid].logprobs, out.logprobs, atol=1e-4)
            np.testing.assert_array_equal(got[tid].versions, out.versions)
            assert got[tid].finish_reason == out.finish_reason
        stats = eng.speculation_stats()
        assert stats.verifications > 0 and stats.accepted > 0
        assert eng.times().decode_tokens == sum(len(o.tokens) for o in plain.values())
    # the second wave repeats the first wave's greedy responses: grouped drafts accept them
    assert stats.accepted_per_verification > 0


def test_recorded_logprobs_are_a_plain_forward_passes() -> None:
    model = peaked_model()
    eng = engine(model, spec(), temperature=1.0)
    done = run(eng, [[req(i, 20) for i in range(4)], [req(i, 20) for i in range(4, 12)]])
    assert eng.speculation_stats().accepted > 0
    for out in done.values():
        ref = reference_logprobs(model, PROMPT, out.tokens, 1.0)
        np.testing.assert_allclose(out.logprobs, ref, atol=1e-4)


def test_same_key_same_tokens_at_temperature_one_and_across_a_resume() -> None:
    model = peaked_model()
    waves = [[req(i, 16) for i in range(8)], [req(i, 16) for i in range(8, 40)]]
    plain = run(engine(model, None, temperature=1.0), waves)
    eng = engine(model, spec(), temperature=1.0)
    eng.submit(waves[0])
    got: dict[int, EngineOutput] = {}
    for step in range(200):
        if not eng.has_work:
            break
        if step == 3:  # interrupt everyone mid-response and resume them
            parts = eng.interrupt(range(8))
            eng.submit(
                [
                    GenerationRequest(t, PROMPT, p.tokens, p.logprobs, p.versions, 16, 0)
                    for t, p in parts.items()
                ]
            )
        for out in eng.step():
            got[out.traj_id] = out
    got.update(run(eng, waves[1:]))
    for tid, out in plain.items():
        np.testing.assert_array_equal(got[tid].tokens, out.tokens)
    stats = eng.speculation_stats()
    assert 0 < stats.accepted < stats.drafted  # drafts were accepted and rejected


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty), without scipy."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over cells with an expected count of at least 5 (the rest pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_sampled_tokens_follow_the_target_distribution_at_temperature_one() -> None:
    """The first three positions' marginals over 1500 trajectories of one group, drafting
    from each other, against the exact marginals of the model (chi-square at 0.1%)."""
    model = peaked_model()
    n, width = 1500, 64
    eng = engine(model, spec(max_draft=4, batch_draft_tokens=4 * width), temperature=1.0)
    waves = [[req(i, 3) for i in range(s, min(n, s + width))] for s in range(0, n, width)]
    done = run(eng, waves)
    toks = np.stack([done[i].tokens for i in range(n)])
    # exact marginals: p(t0), then sum over t0 of p(t0) p(t1 | t0), and likewise for t2
    with torch.inference_mode():
        seqs = torch.tensor(PROMPT, dtype=torch.long)[None]
        marg = torch.ones(1, dtype=torch.float64)
        for pos in range(3):
            p = torch.softmax(model(seqs).logits[:, -1].double(), -1)  # [paths, V]
            joint = marg[:, None] * p
            stat, df = chi2(np.bincount(toks[:, pos], minlength=VOCAB), joint.sum(0).numpy())
            assert stat < chi2_critical(df), f"position {pos}: chi2 {stat:.1f} on {df} df"
            if pos < 2:  # extend by every token of non-negligible joint mass
                flat = joint.flatten()
                top = torch.nonzero(flat > 1e-6)[:, 0]
                marg = flat[top]
                prev = seqs[top // VOCAB]
                seqs = torch.cat([prev, (top % VOCAB)[:, None]], dim=1)
    # the rule was exercised both ways
    stats = eng.speculation_stats()
    assert stats.drafted > 1000 and 0.2 < stats.accepted / stats.drafted < 0.9
    # and a plain engine with the same keys sampled exactly these tokens
    plain = run(engine(model, None, temperature=1.0), waves)
    np.testing.assert_array_equal(np.stack([plain[i].tokens for i in range(n)]), toks)


def test_adaptive_draft_length_and_the_kv_budget() -> None:
    s = SpeculationSettings(max_draft=8, batch_draft_tokens=32)
    assert [s.draft_length(n) for n in (1, 4, 8, 16, 64)] == [8, 8, 4, 2, 0]
    model = peaked_model()
    # 40 running requests with 32 draft tokens for the batch: none drafts
    eng = engine(model, s)
    run(eng, [[req(i, 8) for i in range(40)], [req(i, 8) for i in range(40, 80)]])
    assert eng.speculation_stats().verifications == 0
    # a tight KV budget: drafts are cut to the spare room (run checks the budget each step)
    eng = engine(model, spec(), kv_budget_tokens=48, max_seq_len=48, max_running=1)
    run(eng, [[req(1, 40)], [req(2, 40)]])
    assert eng.speculation_stats().accepted > 0
    assert eng.state().kv_tokens == 0


def test_forgotten_groups_draft_nothing() -> None:
    model = peaked_model()
    eng = engine(model, spec())
    run(eng, [[req(1, 16)]])
    eng.forget_groups([0])
    run(eng, [[req(2, 16, group=0)]])
    own = eng.speculation_stats()
    eng2 = engine(model, spec())
    run(eng2, [[req(1, 16)], [req(2, 16, group=0)]])
    assert eng2.speculation_stats().accepted > own.accepted


def with_method(r: GenerationRequest, method: str | None) -> GenerationRequest:
    return GenerationRequest(
        r.traj_id, r.prompt, r.tokens, r.logprobs, r.versions, r.max_response, r.group_id, method
    )


def test_the_same_key_under_two_draft_methods_samples_the_same_tokens() -> None:
    """Fastest-of-N over draft methods (a race copy drafting otherwise than its original):
    the same trajectories, with the same finished siblings, drafting from the group in one
    engine and from their own history in another, sample the same tokens and logprobs at
    temperature 1, and differ only in what was accepted, counted per method."""
    model = peaked_model()
    siblings = run(engine(model, None, temperature=1.0), [[req(i, 24) for i in range(8)]])
    stragglers = [req(100 + i, 24) for i in range(4)]
    got, stats = {}, {}
    for method in ("group", "own"):
        eng = engine(model, spec("group"), temperature=1.0)
        eng.add_group_responses(0, PROMPT, [o.tokens for o in siblings.values()])
        done = run(
            eng, [[with_method(r, None if method == "group" else method) for r in stragglers]]
        )
        got[method] = done
        by_method = eng.speculation_stats_by_method()
        assert list(by_method) == [method]  # every verification counted under its method
        assert by_method[method] == eng.speculation_stats()
        stats[method] = by_method[method]
    for tid in got["group"]:
        np.testing.assert_array_equal(got["own"][tid].tokens, got["group"][tid].tokens)
        np.testing.assert_allclose(got["own"][tid].logprobs, got["group"][tid].logprobs, atol=1e-4)
    # the siblings' responses are drafts the own history does not have
    assert stats["group"].accepted > stats["own"].accepted


def test_mixed_draft_methods_in_one_batch_are_token_identical_and_counted_apart() -> None:
    model = peaked_model()
    methods = [None, "group", "own", "off"]
    waves = [[req(10 * w + i, 20) for i in range(8)] for w in range(2)]
    plain = run(engine(model, None), waves)
    eng = engine(model, spec("group"))
    mixed = [[with_method(r, methods[i % 4]) for i, r in enumerate(wave)] for wave in waves]
    got = run(eng, mixed)
    for tid, out in plain.items():
        np.testing.assert_array_equal(got[tid].tokens, out.tokens)
        np.testing.assert_allclose(got[tid].logprobs, out.logprobs, atol=1e-4)
    by_method = eng.speculation_stats_by_method()
    assert set(by_method) == {"group", "own"}  # an "off" request verifies no draft
    assert by_method["group"].accepted > 0 and by_method["own"].verifications > 0
    with pytest.raises(ValueError, match="draft_method"):
        eng.submit([with_method(req(99, 4), "eagle")])


def test_draft_window_keeps_exactness_and_cuts_the_drafts_of_low_acceptance() -> None:
    """With the per-request window the tokens are those sampled without drafts (greedy and,
    with the same keys, at temperature 1 across a resume), and fewer draft tokens are
    verified for about the same accepted ones."""
    model = peaked_model()
    waves = [[req(i, 24) for i in range(4)], [req(i, 24) for i in range(4, 12)]]
    for t in (0.0, 1.0):
        plain = run(engine(model, None, temperature=t), waves)
        stats = {}
        for window in (False, True):
            eng = engine(model, spec("own", window=window), temperature=t)
            eng.submit(waves[0])
            got: dict[int, EngineOutput] = {}
            for step in range(400):
                if not eng.has_work:
                    break
                if step == 3:  # interrupt and resume: the window starts again
                    parts = eng.interrupt(range(4))
                    eng.submit(
                        [
                            GenerationRequest(tid, PROMPT, p.tokens, p.logprobs, p.versions, 24, 0)
                            for tid, p in parts.items()
                        ]
                    )
                for out in eng.step():
                    got[out.traj_id] = out
            got.update(run(eng, waves[1:]))
            for tid, out in plain.items():
                np.testing.assert_array_equal(got[tid].tokens, out.tokens)
                np.testing.assert_allclose(got[tid].logprobs, out.logprobs, atol=1e-4)
            stats[window] = eng.speculation_stats()
        assert stats[True].drafted <= stats[False].drafted
        if t > 0:  # sampling rejects drafts (greedy repeats its own history: none rejected)
            assert 0 < stats[True].wasted < stats[False].wasted
            assert stats[True].drafted < stats[False].drafted
