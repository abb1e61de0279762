"""Scheduling, sampling and control of the embedded CPU engine on a tiny Qwen2."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from staleflow.engines.base import (  # noqa: E402
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    GenerationRequest,
    RolloutEngine,
)
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig  # noqa: E402

VOCAB = 48


def req(
    traj_id: int,
    prompt_len: int = 6,
    max_response: int = 8,
    *,
    prefix: EngineOutput | None = None,
    seed: int | None = None,
) -> GenerationRequest:
    rng = np.random.default_rng(traj_id if seed is None else seed)
    prompt = rng.integers(0, VOCAB, size=prompt_len, dtype=np.int32)
    if prefix is None:
        e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        return GenerationRequest(traj_id, prompt, e_i, e_f, e_i, max_response)
    return GenerationRequest(
        traj_id, prompt, prefix.tokens, prefix.logprobs, prefix.versions, max_response
    )


def engine(model, **overrides) -> EmbeddedEngine:
    cfg = dict(kv_budget_tokens=512, max_running=8, max_seq_len=64, temperature=0.0, seed=0)
    cfg.update(overrides)
    return EmbeddedEngine(model, EmbeddedEngineConfig(**cfg))


def drain(eng: EmbeddedEngine, max_steps: int = 500) -> dict[int, EngineOutput]:
    done: dict[int, EngineOutput] = {}
    for _ in range(max_steps):
        if not eng.has_work:
            return done
        for out in eng.step():
            done[out.traj_id] = out
    raise AssertionError("engine did not drain")


def greedy_reference(model, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by full HF forwards (no cache): the ground truth."""
    seq = torch.tensor(prompt, dtype=torch.long)[None]
    toks, lps = [], []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(seq).logits[0, -1].float()
            tok = int(logits.argmax())
            toks.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
    return toks, lps


def check_arrays(out: EngineOutput) -> None:
    assert out.tokens.dtype == np.int32 and out.tokens.ndim == 1
    assert out.logprobs.dtype == np.float32
    assert out.versions.dtype == np.int32
    assert len(out.tokens) == len(out.logprobs) == len(out.versions)


def test_satisfies_the_protocol(make_model) -> None:
    eng: RolloutEngine = engine(make_model())
    for name in ("submit", "step", "interrupt", "abort", "load_weights", "weight_shapes"):
        assert callable(getattr(eng, name))
    assert eng.step() == [] and not eng.has_work


def test_greedy_batch_matches_hf_reference(make_model) -> None:
    model = make_model()
    eng = engine(model)
    # Prompt length 1 leaves nothing to prefill: the first decode step fills the cache.
    requests = [req(i, prompt_len=1 + 3 * i, max_response=5 + i) for i in range(4)]
    eng.submit(requests)
    done = drain(eng)
    assert sorted(done) == [0, 1, 2, 3]
    for r in requests:
        out = done[r.traj_id]
        check_arrays(out)
        toks, lps = greedy_reference(model, r.prompt, r.max_response)
        assert out.tokens.tolist() == toks
        np.testing.assert_allclose(out.logprobs, lps, atol=1e-4)
        assert out.finish_reason == FINISH_LENGTH
        assert (out.versions == 0).all()
    t = eng.times()
    assert t.decode_tokens == sum(r.max_response for r in requests)
    assert t.prefill_tokens == sum(len(r.prompt) - 1 for r in requests)
    assert t.prefill_s > 0 and t.decode_s > 0


def test_continuous_batching_requests_join_as_others_leave(make_model) -> None:
    model = make_model()
    eng = engine(model, max_running=2)
    requests = [req(0, max_response=2), req(1, max_response=6), req(2, max_response=3)]
    eng.submit(requests)
    assert eng.state().waiting == ((0, 6), (1, 6), (2, 6))
    eng.step()
    assert eng.state().running == ((0, 7), (1, 7)) and eng.state().waiting == ((2, 6),)
    finished = eng.step()
    assert [o.traj_id for o in finished] == [0]
    eng.step()  # 2 joins while 1 keeps decoding
    st = eng.state()
    assert st.running == ((1, 9), (2, 7)) and st.waiting == ()
    assert st.kv_tokens == 16
    done = drain(eng)
    assert set(done) == {1, 2}
    for r in requests[1:]:
        assert (
            done[r.traj_id].tokens.tolist() == greedy_reference(model, r.prompt, r.max_response)[0]
        )


def test_eos_stops_and_is_included(make_model) -> None:
    model = make_model()
    r = req(0, max_response=10)
    toks, _ = greedy_reference(model, r.prompt, 3)
    eng = engine(model, eos_token_id=toks[2])
    eng.submit([r])
    out = drain(eng)[0]
    stop = toks.index(toks[2]) + 1
    assert out.tokens.tolist() == toks[:stop] and out.finish_reason == FINISH_STOP


def test_kv_budget_preempts_latest_to_front_and_recomputes(make_model) -> None:
    model = make_model()
    # Three requests of 6 prompt tokens need 7 KV tokens each to start and grow to 22.
    eng = engine(model, kv_budget_tokens=40, max_seq_len=22, max_running=4)
    requests = [req(i, prompt_len=6, max_response=16) for i in range(3)]
    eng.submit([*requests, req(3, prompt_len=6, max_response=4)])
    st = eng.state()
    preempted = []
    done: dict[int, EngineOutput] = {}
    for _ in range(200):
        if not eng.has_work:
            break
        running_before = [tid for tid, _ in eng.state().running]
        for out in eng.step():
            done[out.traj_id] = out
        st = eng.state()
        assert st.kv_tokens <= 40
        assert st.kv_tokens == sum(length for _, length in st.running)
        alive = [t for t in running_before if t not in done]
        gone = [t for t in alive if t not in dict(st.running)]
        if gone:
            # Only the most recently admitted requests are preempted.
            assert gone == alive[-len(gone) :]
            preempted.append((gone, st.waiting))
    assert eng.preemptions > 0
    gone, waiting = preempted[0]
    # The latest admitted went to the head of the queue with its partial response kept.
    assert waiting[0][0] == gone[-1] and waiting[0][1] > 6
    assert set(done) == {0, 1, 2, 3}
    for r in requests:
        out = done[r.traj_id]
        check_arrays(out)
        assert out.tokens.tolist() == greedy_reference(model, r.prompt, 16)[0]


def test_admission_is_fifo_and_stops_at_a_head_that_does_not_fit(make_model) -> None:
    eng = engine(make_model(), kv_budget_tokens=40, max_seq_len=40, max_running=4)
    eng.submit([req(0, prompt_len=20, max_response=4), req(1, prompt_len=30, max_response=4)])
    eng.submit([req(2, prompt_len=2, max_response=4)])
    eng.step()
    st = eng.state()
    assert [t for t, _ in st.running] == [0]
    assert [t for t, _ in st.waiting] == [1, 2]  # 2 would fit but does not jump the queue


def test_interrupt_then_resume_continues_the_prefix(make_model) -> None:
    model = make_model()
    eng = engine(model, temperature=1.0, top_p=0.9, seed=7)
    eng.submit([req(0, max_response=12), req(1, max_response=12)])
    for _ in range(5):
        eng.step()
    parts = eng.interrupt([0, 99, 0])
    assert list(parts) == [0]
    part = parts[0]
    check_arrays(part)
    assert part.finish_reason is None and len(part.tokens) == 5
    assert eng.state().running == ((1, 6 + 5),)
    assert eng.interrupt([0]) == {}
    eng.load_weights({n: p.detach().clone() for n, p in model.named_parameters()}, version=3)
    eng.submit([req(0, max_response=12, prefix=part)])
    done = drain(eng)
    out = done[0]
    check_arrays(out)
    np.testing.assert_array_equal(out.tokens[:5], part.tokens)
    np.testing.assert_array_equal(out.logprobs[:5], part.logprobs)
    assert out.versions.tolist() == [0] * 5 + [3] * 7
    assert len(out.tokens) == 12 and out.finish_reason == FINISH_LENGTH
    # Draws are keyed by (seed, trajectory, index), so the cycle changed nothing.
    ref = engine(make_model(), temperature=1.0, top_p=0.9, seed=7)
    ref.submit([req(0, max_response=12)])
    assert drain(ref)[0].tokens.tolist() == out.tokens.tolist()


def test_abort_drops_running_and_waiting(make_model) -> None:
    eng = engine(make_model(), max_running=1)
    eng.submit([req(0), req(1), req(2)])
    eng.step()
    assert eng.abort([1, 0, 5]) == [1, 0]
    st = eng.state()
    assert st.running == () and st.waiting == ((2, 6),) and st.kv_tokens == 0
    assert set(drain(eng)) == {2}
    assert eng.abort([2]) == []


def test_sampling_is_seeded_and_logprobs_are_tempered_before_top_p(make_model) -> None:
    model = make_model()
    temperature, top_p = 0.7, 0.6

    def run(seed: int, order: list[int]) -> dict[int, EngineOutput]:
        eng = engine(model, temperature=temperature, top_p=top_p, seed=seed, max_running=3)
        eng.submit([req(i, max_response=10) for i in order])
        return drain(eng)

    a, b, c = run(1, [0, 1, 2, 3]), run(1, [0, 1, 2, 3]), run(2, [0, 1, 2, 3])
    # Draws are keyed by (seed, trajectory, index): another order and batching agree too.
    d = run(1, [3, 2, 1, 0])
    for i in range(4):
        np.testing.assert_array_equal(a[i].tokens, b[i].tokens)
        np.testing.assert_array_equal(a[i].tokens, d[i].tokens)
    assert any(not np.array_equal(a[i].tokens, c[i].tokens) for i in range(4))
    with torch.inference_mode():
        for i in range(4):
            prompt = req(i).prompt
            seq = torch.tensor(np.concatenate([prompt, a[i].tokens]), dtype=torch.long)[None]
            logits = model(seq).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits / temperature, -1)
            toks = torch.from_numpy(a[i].tokens.astype(np.int64))
            ref = logp.gather(1, toks[:, None])[:, 0]
            np.testing.assert_allclose(a[i].logprobs, ref.numpy(), atol=1e-4)
            # Every sampled token lies in its top-p nucleus.
            probs = logp.exp()
            sorted_p, order = probs.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p
            for t in range(len(toks)):
                nucleus = order[t][before[t] < top_p].tolist()
                assert int(toks[t]) in nucleus


def test_load_weights_names_shapes_and_version(make_model) -> None:
    model = make_model()
    eng = engine(model)
    shapes = eng.weight_shapes()
    assert list(shapes) == [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in shapes  # tied to the embeddings, listed once
    assert shapes["model.embed_tokens.weight"] == ((VOCAB, 64), "float32")
    other = make_model(seed=5)
    new = {n: p.detach().numpy().copy() for n, p in other.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad_shape = dict(new, **{"model.norm.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        eng.load_weights(bad_shape, version=1)
    with pytest.raises(ValueError, match="bogus"):
        eng.load_weights(dict(new, bogus=np.zeros(1, np.float32)), version=1)
    missing = {k: v for k, v in new.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        eng.load_weights(missing, version=1)
    as_int = dict(new, **{"model.norm.weight": np.zeros(64, np.int64)})
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        eng.load_weights(as_int, version=1)
    for n, p in model.named_parameters():  # failed loads changed nothing
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
    assert eng.state().version == 0

    r = req(0, max_response=6)
    eng.submit([r])
    eng.step()
    eng.step()
    eng.load_weights(new, version=4)
    assert eng.state().version == 4
    out = drain(eng)[0]
    assert out.versions.tolist() == [0, 0, 4, 4, 4, 4]
    # The copy went into the engine's model in place, tied weights still shared.
    for n, p in other.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n].detach(), p.detach())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bad_submissions_raise_and_change_nothing(make_model) -> None:
    eng = engine(make_model(), max_seq_len=20)
    eng.submit([req(0)])
    good = req(1)
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    prompt = np.arange(4, dtype=np.int32)
    cases = {
        "duplicate": [good, req(0)],
        "twice in one call": [good, req(1)],
        "float prompt": [good, GenerationRequest(7, prompt.astype(np.float32), e_i, e_f, e_i, 4)],
        "2-D prompt": [good, GenerationRequest(7, prompt[None], e_i, e_f, e_i, 4)],
        "empty prompt": [good, GenerationRequest(7, e_i, e_i, e_f, e_i, 4)],
        "out of vocab": [good, GenerationRequest(7, prompt + VOCAB, e_i, e_f, e_i, 4)],
        "lengths": [
            good,
            GenerationRequest(7, prompt, np.ones(2, np.int32), np.zeros(1, np.float32), e_i, 4),
        ],
        "int logprobs": [
            good,
            GenerationRequest(7, prompt, np.ones(1, np.int32), np.ones(1, np.int32), e_i[:0], 4),
        ],
        "too long": [good, GenerationRequest(7, prompt, e_i, e_f, e_i, 17)],
        "finished prefix": [
            good,
            GenerationRequest(
                7, prompt, np.ones(2, np.int32), np.zeros(2, np.float32), np.zeros(2, np.int32), 2
            ),
        ],
        "zero max_response": [good, GenerationRequest(7, prompt, e_i, e_f, e_i, 0)],
    }
    for name, batch in cases.items():
        expected_id = "1" if "twice" in name else ("0" if name == "duplicate" else "7")
        with pytest.raises(ValueError, match=f"trajectory {expected_id}"):
            eng.submit(batch)
        assert eng.state().waiting == ((0, 6),), name
    eng.submit([good])
    assert [t for t, _ in eng.state().waiting] == [0, 1]


def test_resumed_prefix_tokens_are_kept_as_given(make_model) -> None:
    eng = engine(make_model())
    prefix = EngineOutput(
        0, np.array([3, 4, 5], np.int32), np.array([-1, -2, -3], np.float32),
        np.array([1, 1, 2], np.int32), None,
    )  # fmt: skip
    eng.submit([req(0, max_response=5, prefix=prefix)])
    assert eng.state().waiting == ((0, 9),)
    out = drain(eng)[0]
    assert out.tokens[:3].tolist() == [3, 4, 5]
    assert out.logprobs[:3].tolist() == [-1, -2, -3]
    assert out.versions.tolist() == [1, 1, 2, 0, 0]
    assert len(out.tokens) == 5


@pytest.mark.parametrize(
    ("field", "value", "hint"),
    [
        ("kv_budget_tokens", 0, "positive int"),
        ("kv_budget_tokens", 10, "raise kv_budget_tokens"),
        ("max_running", 0, "positive int"),
        ("temperature", -1.0, "greedy"),
        ("temperature", float("nan"), "finite"),
        ("top_p", 0.0, r"\(0, 1\]"),
        ("top_p", 1.5, r"\(0, 1\]"),
        ("eos_token_id", -3, "non-negative"),
        ("num_threads", 0, "positive int"),
        ("max_prefill_tokens", 0, "positive int"),
    ],
)
def test_config_validation(field: str, value: object, hint: str) -> None:
    base = EmbeddedEngineConfig(kv_budget_tokens=64, max_seq_len=32)
    with pytest.raises(ValueError, match=hint):
        dataclasses.replace(base, **{field: value})


def test_engine_checks_the_config_against_the_model(make_model, caplog) -> None:
    with caplog.at_level("WARNING"):
        engine(make_model(), max_seq_len=256, kv_budget_tokens=256)
    assert "max_position_embeddings" in caplog.text
    with pytest.raises(ValueError, match="vocabulary"):
        engine(make_model(), eos_token_id=VOCAB)


def test_batched_prefill_respects_the_token_cap(make_model) -> None:
    model = make_model()
    eng = engine(model, max_prefill_tokens=16)
    requests = [req(i, prompt_len=3 + 4 * i, max_response=3) for i in range(4)]
    eng.submit(requests)
    done = drain(eng)
    for r in requests:
        assert done[r.traj_id].tokens.tolist() == greedy_reference(model, r.prompt, 3)[0]


def test_a_race_copy_on_another_engine_samples_the_originals_tokens(make_model) -> None:
    """runtime/controller/races.py: a copy of trajectory 0 forked from its first tokens, alone on a
    second engine with the run's seed and the same weights, produces exactly the tokens of
    the original running in a batch with others: the kept response does not depend on
    which side finished first."""
    model = make_model()
    holder = engine(model, temperature=1.0, top_p=0.9, seed=11)
    holder.submit([req(0, max_response=16), req(1, max_response=16), req(2, max_response=16)])
    for _ in range(3):
        holder.step()
    fork = holder.progress()[0]  # what its progress report gave the TS; it goes on
    original = drain(holder)[0]
    copy_engine = engine(make_model(), temperature=1.0, top_p=0.9, seed=11)
    copy_engine.submit([req(0, max_response=16, prefix=fork)])
    copy = drain(copy_engine)[0]
    assert len(fork.tokens) == 3
    assert copy.tokens.tolist() == original.tokens.tolist()
    np.testing.assert_allclose(copy.logprobs, original.logprobs, rtol=1e-5, atol=1e-6)
