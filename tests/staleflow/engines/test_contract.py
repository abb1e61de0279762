"""The rollout-engine contract (``staleflow/engines/base.py``), one suite for every backend.

Backends and where each runs: see ``backends.py``. One engine per backend for the whole
module (vLLM takes 10-60 s to start); each test leaves it empty.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from staleflow.engines.base import FINISH_LENGTH, FINISH_STOP, GenerationRequest
from tests.staleflow.engines.backends import (
    MAX_SEQ,
    PARAMS,
    VOCAB,
    Backend,
    backend_fixture,
    build_model,
    drain,
    model_folder,  # noqa: F401  (fixture)
    teacher_forced,
)

TOL = 2e-5  # float32 logprobs of a 2-layer model: measured errors are ~5e-7
_ids = itertools.count(1000)
_versions = itertools.count(1)


@pytest.fixture(scope="module", params=PARAMS)
def backend(request, model_folder, tmp_path_factory) -> Iterator[Backend]:  # noqa: F811
    yield from backend_fixture(request, model_folder, tmp_path_factory)


@pytest.fixture
def eng(backend: Backend):
    yield backend.engine
    leftover = [t for t, _ in (*backend.engine.state().running, *backend.engine.state().waiting)]
    backend.engine.abort(leftover)
    drain(backend.engine)


def request(
    prompt_len: int = 8,
    max_response: int = 24,
    *,
    seed: int | None = None,
    traj_id: int | None = None,
    prefix: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    prompt: np.ndarray | None = None,
) -> GenerationRequest:
    tid = next(_ids) if traj_id is None else traj_id
    rng = np.random.default_rng(tid if seed is None else seed)
    if prompt is None:
        prompt = rng.integers(0, VOCAB, size=prompt_len, dtype=np.int32)
    if prefix is None:
        e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        prefix = (e_i, e_f, e_i)
    return GenerationRequest(tid, prompt, *prefix, max_response)


def check_output(out, req: GenerationRequest, eos: int) -> None:
    assert out.tokens.dtype == np.int32 and out.logprobs.dtype == np.float32
    assert out.versions.dtype == np.int32
    assert len(out.tokens) == len(out.logprobs) == len(out.versions) <= req.max_response
    body = out.tokens[:-1].tolist()
    assert eos not in body, "a response went on past its stop token"
    if out.finish_reason == FINISH_STOP:
        assert out.tokens[-1] == eos
    else:
        assert out.finish_reason == FINISH_LENGTH
        assert len(out.tokens) == req.max_response


def check_logprobs(model, req: GenerationRequest, out, start: int = 0) -> None:
    ref = teacher_forced(model, req.prompt, out.tokens)
    np.testing.assert_allclose(out.logprobs[start:], ref[start:], atol=TOL, rtol=0)


def test_weight_shapes_are_the_hf_parameters(eng) -> None:
    model = build_model(0)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert {n: s for n, (s, _) in eng.weight_shapes().items()} == shapes


def test_generates_from_token_ids_with_the_logprob_convention(backend, eng) -> None:
    reqs = [request(prompt_len=3 + i) for i in range(12)]
    eng.submit(reqs)
    done = drain(eng)
    assert sorted(done) == sorted(r.traj_id for r in reqs)
    for r in reqs:
        out = done[r.traj_id]
        check_output(out, r, backend.eos)
        assert set(out.versions.tolist()) == {eng.state().version}
        check_logprobs(backend.reference, r, out)
    reasons = {o.finish_reason for o in done.values()}
    assert FINISH_STOP in reasons, "no response stopped at the stop token"


def test_a_resubmitted_prefix_is_kept_and_continued(backend, eng) -> None:
    # the prefix must stop short of the stop token (an ended response is never resubmitted);
    # an engine that samples unseeded (SGLang here) sometimes answers with it alone
    for _ in range(8):
        first = request(max_response=20)
        eng.submit([first])
        whole = drain(eng)[first.traj_id]
        body = len(whole.tokens) - (whole.finish_reason == FINISH_STOP)
        if body >= 1:
            break
    else:
        pytest.fail("8 responses in a row were their stop token alone")
    k = max(1, body // 2)
    fake_versions = np.full(k, -7, np.int32)  # the engine must keep what it was given
    resumed = request(
        max_response=20,
        prompt=first.prompt,
        prefix=(whole.tokens[:k].copy(), whole.logprobs[:k].copy(), fake_versions),
    )
    eng.submit([resumed])
    out = drain(eng)[resumed.traj_id]
    np.testing.assert_array_equal(out.tokens[:k], whole.tokens[:k])
    np.testing.assert_array_equal(out.logprobs[:k], whole.logprobs[:k])
    assert out.versions[:k].tolist() == [-7] * k
    check_output(out, resumed, backend.eos)
    check_logprobs(backend.reference, resumed, out, start=k)


def test_a_resubmission_after_an_observation_continues_after_it(backend, eng) -> None:
    """A multi-turn trajectory's next turn (docs/agentic.md): its response so far is a
    model turn that ended at the stop token, then observation tokens (logprob 0, the
    version of the token before them). The engine keeps all of it as given and
    generates after it: the stop token inside the prefix ends nothing."""
    if backend.eos is None:
        pytest.skip("this backend's model has no stop token")
    first = request(max_response=6)
    turn = np.array([*np.random.default_rng(7).integers(0, VOCAB, 3), backend.eos], np.int32)
    observation = np.random.default_rng(8).integers(0, VOCAB, 4).astype(np.int32)
    tokens = np.concatenate([turn, observation])
    logprobs = np.concatenate([np.full(4, -1.25, np.float32), np.zeros(4, np.float32)])
    versions = np.array([3, 3, 3, 3, 3, 3, 3, 3], np.int32)
    resumed = request(
        max_response=len(tokens) + 6, prompt=first.prompt, prefix=(tokens, logprobs, versions)
    )
    eng.submit([resumed])
    out = drain(eng)[resumed.traj_id]
    n = len(tokens)
    np.testing.assert_array_equal(out.tokens[:n], tokens)
    np.testing.assert_array_equal(out.logprobs[:n], logprobs)
    assert out.versions[:n].tolist() == versions.tolist()
    new = out.tokens[n:]
    assert len(new) >= 1, "the stop token of an earlier turn ended the next one"
    assert backend.eos not in new[:-1].tolist()
    assert out.finish_reason == (FINISH_STOP if new[-1] == backend.eos else FINISH_LENGTH)
    check_logprobs(backend.reference, resumed, out, start=n)


def test_interrupt_returns_the_partial_response_and_forgets_it(backend, eng) -> None:
    reqs = [request(max_response=MAX_SEQ - 10) for _ in range(4)]
    eng.submit(reqs)
    early = {o.traj_id: o for o in eng.step()}
    target = reqs[0].traj_id
    parts = eng.interrupt([target, 424242])
    finished = {**early, **drain(eng)}
    if target in parts:
        part = parts[target]
        assert part.finish_reason is None
        assert len(part.tokens) == len(part.logprobs) == len(part.versions) < reqs[0].max_response
        if len(part.tokens):
            check_logprobs(backend.reference, reqs[0], part)
        assert target not in finished
    else:  # it finished before the interrupt: then it is a completion, reported once
        assert target in finished
    assert set(finished) | set(parts) == {r.traj_id for r in reqs}
    assert eng.interrupt([target]) == {}


def test_progress_is_a_prefix_of_what_an_interrupt_returns(backend, eng) -> None:
    """An engine that reports progress (``ReportsProgress``) reports only tokens that stay
    in the response: the TS keeps them when the instance is lost (docs/recovery.md)."""
    if not hasattr(eng, "progress"):
        pytest.skip(f"{backend.name} does not report progress: a lost instance regenerates")
    reqs = [request(max_response=MAX_SEQ - 10) for _ in range(3)]
    eng.submit(reqs)
    assert set(eng.progress()) == {r.traj_id for r in reqs}  # submitted, none generated yet
    early = {o.traj_id: o for o in eng.step()}
    early.update({o.traj_id: o for o in eng.step()})
    seen = eng.progress()
    assert not set(seen) & set(early)  # a finished request is no longer in progress
    parts = eng.interrupt(list(seen))
    assert set(parts) == set(seen)
    for tid, o in seen.items():
        assert o.finish_reason is None
        n = len(o.tokens)
        assert len(o.logprobs) == len(o.versions) == n
        assert np.array_equal(parts[tid].tokens[:n], o.tokens)
        assert np.array_equal(parts[tid].logprobs[:n], o.logprobs)
        assert np.array_equal(parts[tid].versions[:n], o.versions)
    assert any(len(o.tokens) for o in seen.values()), "two steps generated nothing"
    assert eng.progress() == {}


def test_abort_drops_requests_for_good(eng) -> None:
    reqs = [request() for _ in range(3)]
    eng.submit(reqs)
    dropped = eng.abort([reqs[0].traj_id, reqs[1].traj_id, 424242])
    assert sorted(dropped) == sorted([reqs[0].traj_id, reqs[1].traj_id])
    assert set(drain(eng)) == {reqs[2].traj_id}


def test_state_lists_every_request_with_its_length(eng) -> None:
    reqs = [request(prompt_len=5 + i, max_response=30) for i in range(5)]
    eng.submit(reqs)
    state = eng.state()
    listed = dict((*state.running, *state.waiting))
    assert set(listed) == {r.traj_id for r in reqs}
    for r in reqs:
        assert listed[r.traj_id] >= len(r.prompt)
    assert state.kv_tokens == sum(n for _, n in state.running)
    assert state.preemptions >= 0
    assert state.kv_usage is None or 0.0 <= state.kv_usage <= 1.0
    eng.step()
    state = eng.state()
    assert len({t for t, _ in (*state.running, *state.waiting)}) == len(state.running) + len(
        state.waiting
    )


def test_weights_load_between_steps_without_dropping_requests(backend, eng) -> None:
    reqs = [request(max_response=40) for _ in range(6)]
    before = eng.times().decode_tokens
    backend.hold()
    eng.submit(reqs)
    early = {o.traj_id: o for o in backend.advance(len(reqs))}  # running, a token each
    old = eng.state().version
    version = next(_versions) + old
    new_model = build_model(version)
    backend.load(new_model, version)
    backend.release()
    assert eng.state().version == version
    done = {**early, **drain(eng)}
    assert sorted(done) == sorted(r.traj_id for r in reqs), "a request was dropped by the load"
    for r in reqs:
        out = done[r.traj_id]
        check_output(out, r, backend.eos)
        vs = out.versions.tolist()
        assert vs == sorted(vs) and set(vs) <= {old, version}
    if backend.can_hold:  # some request was running across the load
        assert any(old in o.versions and version in o.versions for o in done.values())
    assert eng.times().decode_tokens >= before + sum(len(o.tokens) for o in done.values()) - 6
    # fresh requests follow the new weights exactly
    fresh = [request() for _ in range(4)]
    eng.submit(fresh)
    after = drain(eng)
    for r in fresh:
        assert set(after[r.traj_id].versions.tolist()) == {version}
        check_logprobs(backend.reference, r, after[r.traj_id])


def test_no_stale_prefix_is_reused_after_a_weight_load(backend, eng) -> None:
    prompt = np.random.default_rng(7).integers(0, VOCAB, size=70, dtype=np.int32)
    first = request(prompt=prompt, max_response=4)
    eng.submit([first])
    drain(eng)  # the prompt's KV now sits in any prefix cache
    version = eng.state().version + next(_versions)
    backend.load(build_model(version), version)
    again = request(prompt=prompt, max_response=4)
    eng.submit([again])
    out = drain(eng)[again.traj_id]
    check_logprobs(backend.reference, again, out)


def test_bad_requests_are_refused_by_trajectory_and_change_nothing(eng) -> None:
    good = request()
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    cases = [
        ([good, request(traj_id=good.traj_id)], "duplicate"),
        (
            [good, GenerationRequest(5, np.array([VOCAB + 3], np.int32), e_i, e_f, e_i, 4)],
            "vocabulary",
        ),
        ([good, request(prompt_len=MAX_SEQ, max_response=8)], "max_seq_len"),
        (
            [
                good,
                GenerationRequest(6, np.array([1], np.int32), np.array([2], np.int32), e_f, e_i, 4),
            ],
            "one entry per token",
        ),
    ]
    for batch, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.submit(batch)
        assert not eng.has_work
        assert eng.state().waiting == () and eng.state().running == ()


def test_bad_weights_are_refused_by_name_and_change_nothing(backend, eng) -> None:
    version = eng.state().version
    weights = {n: p.detach().numpy() for n, p in build_model(99).named_parameters()}
    name = next(iter(weights))
    missing = {k: v for k, v in weights.items() if k != name}
    with pytest.raises(ValueError, match=name):
        eng.load_weights(missing, version + 1)
    wrong = dict(weights, **{name: np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match=name):
        eng.load_weights(wrong, version + 1)
    assert eng.state().version == version
    r = request()
    eng.submit([r])
    check_logprobs(backend.reference, r, drain(eng)[r.traj_id])


def test_a_race_copy_resumed_at_the_originals_point_samples_its_tokens(backend, eng) -> None:
    """What the tail race needs (runtime/controller/races.py): a trajectory resubmitted at the same
    response, under the same weights, samples the same tokens whatever ran beside it, so
    a copy forked where its original resumed keeps what the original would have. The
    embedded engine keys draws by token index, vLLM by position (worker.KeyedSampler),
    SGLang with deterministic inference by position (the suite's servers run with it:
    launch refuses the race on SGLang without it). Forks at any token, at lengths where
    vLLM splits the prompt: test_contract_long."""
    if not backend.seeded_draws:
        pytest.skip(
            f"{backend.name} samples unseeded here: SGLang 0.5.23 has no deterministic "
            "inference on CPU (no attention backend for it), so the race cannot run on it"
        )
    tid = next(_ids)
    first = request(traj_id=tid, max_response=6)
    eng.submit([first])
    prefix = drain(eng)[tid]  # the response so far, where both resume
    given = (prefix.tokens, prefix.logprobs, prefix.versions)
    original = request(traj_id=tid, max_response=20, prefix=given)
    eng.submit([original, request(max_response=20), request(max_response=20)])
    held = drain(eng)[tid]
    eng.submit([request(traj_id=tid, max_response=20, prefix=given)])  # the copy, alone
    copy = drain(eng)[tid]
    assert copy.tokens.tolist() == held.tokens.tolist()
    np.testing.assert_allclose(copy.logprobs, held.logprobs, atol=TOL, rtol=0)


# -- multi-turn (docs/agentic.md): a turn ends at the stop token, the environment's
# observation is appended (logprob 0, the version of the token before it, mask False), and
# the trajectory comes back for its next turn, to the engine that ran the turn before: the
# embedded engine keeps that turn's KV (prefix_store), vLLM's prefix cache holds its blocks.

TURN_PROMPT = 40  # with its first turn, more than one of vLLM's 32-token blocks: cacheable


def first_turn(backend: Backend, eng) -> tuple[GenerationRequest, object]:
    """A first turn that ended at the stop token: the first trajectory (of a fixed
    sequence of ids and prompts) whose turn does, so the case is the same on every run;
    draws are keyed by trajectory, so each try is a new id. Under the suite's first
    weights, whose most frequent token is the stop token (earlier cases load others)."""
    version = eng.state().version + next(_versions)
    backend.load(build_model(0), version)
    seen = []
    for seed in range(40):
        req = request(TURN_PROMPT, max_response=12, seed=seed)
        eng.submit([req])
        out = drain(eng)[req.traj_id]
        seen.append((out.finish_reason, out.tokens.tolist()))
        if out.finish_reason == FINISH_STOP:
            check_output(out, req, backend.eos)
            assert set(out.versions.tolist()) == {eng.state().version}
            check_logprobs(backend.reference, req, out)
            return req, out
    raise AssertionError(f"no first turn ended at the stop token {backend.eos}: {seen[:3]}")


def next_turn(first: GenerationRequest, out, max_new: int = 12):
    """The next turn's request: the turn, then a four-token observation; and its mask."""
    obs = np.random.default_rng(first.traj_id).integers(0, VOCAB, 4).astype(np.int32)
    tokens = np.concatenate([out.tokens, obs])
    logprobs = np.concatenate([out.logprobs, np.zeros(4, np.float32)])
    versions = np.concatenate([out.versions, np.full(4, out.versions[-1], np.int32)])
    mask = np.concatenate([np.ones(len(out.tokens), bool), np.zeros(4, bool)])
    req = request(
        max_response=len(tokens) + max_new,
        traj_id=first.traj_id,
        prompt=first.prompt,
        prefix=(tokens, logprobs, versions),
    )
    return req, mask


def check_turn(backend: Backend, req: GenerationRequest, mask, out, version: int) -> None:
    """Exactly what the next turn must hold: the prefix as given (tokens, logprobs,
    versions), the new tokens' logprobs a full forward's (teacher-forced over prompt,
    turns and observation), their version the engine's; the mask the instance extends
    (trajectory_server.types.extend_mask) trains exactly the engine's tokens."""
    from trajectory_server.types import extend_mask

    n = len(req.tokens)
    np.testing.assert_array_equal(out.tokens[:n], req.tokens)
    np.testing.assert_array_equal(out.logprobs[:n], req.logprobs)
    assert out.versions[:n].tolist() == req.versions.tolist()
    assert len(out.tokens) > n, "the stop token of the earlier turn ended the next one"
    assert set(out.versions[n:].tolist()) == {version}
    assert len(out.tokens) == len(out.logprobs) == len(out.versions) <= req.max_response
    assert backend.eos not in out.tokens[n:-1].tolist(), "the turn went on past its stop token"
    if out.finish_reason == FINISH_STOP:
        assert out.tokens[-1] == backend.eos
    else:
        assert out.finish_reason == FINISH_LENGTH and len(out.tokens) == req.max_response
    check_logprobs(backend.reference, req, out, start=n)
    full = extend_mask(mask, len(out.tokens))
    assert full.tolist() == [*mask.tolist(), *([True] * (len(out.tokens) - n))]
    assert not out.logprobs[~full].any()  # observations: never the model's


def test_a_turn_ends_at_its_stop_token_and_the_next_continues_after_the_observation(
    backend, eng
) -> None:
    """A real turn of this engine, then its next turn on the same engine: the turn's KV
    is reused where the engine keeps it (embedded: held_prefixes, then a prefix hit;
    vLLM: its prefix cache's hit), and the next turn is exactly a full re-prefill's."""
    if backend.eos is None:
        pytest.skip("this backend's model has no stop token")
    first, out = first_turn(backend, eng)
    tid = first.traj_id
    held = getattr(eng, "held_prefixes", None)
    if held is not None:
        assert tid in held()
    before = eng.times()
    req, mask = next_turn(first, out)
    eng.submit([req])
    second = drain(eng)[tid]
    check_turn(backend, req, mask, second, eng.state().version)
    after = eng.times()
    if backend.name in ("embedded", "vllm"):  # both reuse the earlier turn's KV
        assert after.prefix_tokens > before.prefix_tokens, (before, after)


def test_an_interrupt_inside_a_later_turn_keeps_the_turns_and_resumes_exactly(backend, eng) -> None:
    """Interrupted one step into its second turn, a trajectory returns its turns, the
    observation and the new tokens exactly; resumed, it generates (with seeded draws)
    exactly the turn it would have straight through."""
    if backend.eos is None:
        pytest.skip("this backend's model has no stop token")
    first, out = first_turn(backend, eng)
    tid = first.traj_id
    req, mask = next_turn(first, out, max_new=24)
    backend.hold()
    eng.submit([req])
    early = {o.traj_id: o for o in backend.advance(1)}
    parts = eng.interrupt([tid])
    backend.release()
    version = eng.state().version
    assert tid in parts or not backend.can_hold, "held one step in, the turn had finished"
    if tid not in parts:  # it finished before the interrupt (a real SGLang server runs on)
        check_turn(backend, req, mask, {**early, **drain(eng)}[tid], version)
        return
    part = parts[tid]
    n = len(req.tokens)
    assert part.finish_reason is None
    np.testing.assert_array_equal(part.tokens[:n], req.tokens)
    np.testing.assert_array_equal(part.logprobs[:n], req.logprobs)
    assert part.versions[:n].tolist() == req.versions.tolist()
    assert set(part.versions[n:].tolist()) <= {version}
    check_logprobs(backend.reference, req, part, start=n)
    resumed = request(
        max_response=req.max_response,
        traj_id=tid,
        prompt=req.prompt,
        prefix=(part.tokens, part.logprobs, part.versions),
    )
    eng.submit([resumed])
    whole = drain(eng)[tid]
    check_turn(backend, req, mask, whole, version)
    np.testing.assert_array_equal(whole.tokens[: len(part.tokens)], part.tokens)
    if backend.seeded_draws:
        eng.submit([req])  # the same turn, straight through
        straight = drain(eng)[tid]
        assert whole.tokens.tolist() == straight.tokens.tolist()
        np.testing.assert_allclose(whole.logprobs, straight.logprobs, atol=TOL, rtol=0)


def test_a_next_turn_after_a_weight_load_is_the_new_weights_reprefill(backend, eng) -> None:
    """A turn's KV kept under the old weights is not reused after a load: the next
    turn's tokens carry the new version and the new weights' logprobs over the whole
    prefix (docs/agentic.md: re-prefilling after a Pull)."""
    if backend.eos is None:
        pytest.skip("this backend's model has no stop token")
    first, out = first_turn(backend, eng)
    tid = first.traj_id
    version = eng.state().version + next(_versions)
    backend.load(build_model(version), version)
    held = getattr(eng, "held_prefixes", None)
    if held is not None:
        assert held() == ()
    req, mask = next_turn(first, out)
    eng.submit([req])
    check_turn(backend, req, mask, drain(eng)[tid], version)
