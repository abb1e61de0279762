"""The engine contract at realistic lengths: prompts longer than the engine's per-step
prefill budget, responses of hundreds of tokens, a Pull in the middle.

vLLM gets a budget of ``BUDGET`` tokens per step (``max_num_batched_tokens``), below every
prompt here, so it splits each prompt across engine steps (chunked prefill), between and
beside other requests' decodes. Before its draws were keyed by position
(``staleflow/engines/vllm/worker.py`` ``KeyedSampler``), the first split of a seeded request
crashed the engine ("CPU Generator does not use offset", issue 32). The embedded engine runs
a prompt longer than its ``max_prefill_tokens`` alone in one forward: the same cases hold
for it. Backends and where each runs: ``backends.py`` (vLLM in CI's vLLM stage).

Responses end at their length only (no stop token), so every one is hundreds of tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from staleflow.engines.base import FINISH_LENGTH, GenerationRequest
from tests.staleflow.engines.backends import (
    PARAMS,
    VOCAB,
    Backend,
    build_model,
    drain,
    model_folder,  # noqa: F401  (fixture)
    open_backend,
    teacher_forced,
)
from tests.staleflow.engines.test_contract import TOL

BUDGET = 32  # tokens one step may prefill; every prompt below is longer
LONG_SEQ = 512
_ids = itertools.count(5000)


@pytest.fixture(scope="module", params=[p for p in PARAMS if p.id in ("embedded", "vllm")])
def backend(request, model_folder, tmp_path_factory) -> Iterator[Backend]:  # noqa: F811
    b = open_backend(
        request.param,
        model_folder,
        build_model(0),
        tmp_path_factory.mktemp("engine-logs"),
        stop=False,
        max_seq=LONG_SEQ,
        prefill_budget=BUDGET,
    )
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def eng(backend: Backend):
    yield backend.engine
    backend.engine.abort(list(backend.engine.progress()))
    drain(backend.engine)


def long_request(
    prompt_len: int,
    max_response: int,
    *,
    traj_id: int | None = None,
    prefix: Any = None,
) -> GenerationRequest:
    tid = next(_ids) if traj_id is None else traj_id
    prompt = np.random.default_rng(tid).integers(0, VOCAB, size=prompt_len, dtype=np.int32)
    assert prompt_len > BUDGET
    if prefix is None:
        e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        prefix = (e_i, e_f, e_i)
    else:
        prefix = (prefix.tokens.copy(), prefix.logprobs.copy(), prefix.versions.copy())
    return GenerationRequest(tid, prompt, *prefix, max_response)


def check_by_version(
    models: dict[int, Any], req: GenerationRequest, out: Any, versions: Any = None
) -> None:
    """Each token's logprob is ``log_softmax(logits / T)`` of the weights of its version
    (of the ``versions`` given; all by default)."""
    assert out.finish_reason == FINISH_LENGTH and len(out.tokens) == req.max_response
    assert len(out.logprobs) == len(out.versions) == req.max_response
    for version in set(out.versions.tolist()) if versions is None else versions:
        ref = teacher_forced(models[version], req.prompt, out.tokens)
        mask = out.versions == version
        np.testing.assert_allclose(out.logprobs[mask], ref[mask], atol=TOL, rtol=0)


def copy_of(model: Any) -> Any:
    held = build_model(0)
    held.load_state_dict(model.state_dict())
    return held


def test_prompts_longer_than_the_prefill_budget_generate_hundreds_of_tokens(backend, eng) -> None:
    reqs = [long_request(40 + 24 * i, 256 - 20 * i) for i in range(6)]
    eng.submit(reqs)
    first = eng.step()
    if backend.name == "vllm":  # no prompt fits one step: none has a token yet
        assert first == [] and all(len(o.tokens) == 0 for o in eng.progress().values())
    done = drain(eng)
    version = eng.state().version
    assert sorted(done) == sorted(r.traj_id for r in reqs)
    for r in reqs:
        assert set(done[r.traj_id].versions.tolist()) == {version}
        check_by_version({version: backend.reference}, r, done[r.traj_id])


def test_a_pull_in_the_middle_of_split_prefills_and_long_decodes(backend, eng) -> None:
    old = eng.state().version
    models = {old: copy_of(backend.reference)}
    reqs = [long_request(60 + 20 * i, 240) for i in range(5)]
    eng.submit(reqs)
    early = []
    for _ in range(6):  # vLLM: 192 of the 500 prompt tokens prefilled, two decoding
        early += eng.step()
    assert early == []
    at_pull = {t: len(o.tokens) for t, o in eng.progress().items()}
    version = old + 1 + next(_ids) % 7
    models[version] = build_model(version)
    backend.load(models[version], version)
    late = [long_request(100, 200) for _ in range(2)]  # submitted after the Pull
    eng.submit(late)
    done = drain(eng)
    assert sorted(done) == sorted(r.traj_id for r in reqs + late), "a request was dropped"
    # vLLM recomputes the KV of its running requests under the new weights (the load
    # resets its prefix cache), so every token after the Pull is the new model's exactly;
    # the embedded engine keeps the KV the old weights computed (EmbeddedEngine.load_weights)
    exact_after = backend.name == "vllm"
    for r in reqs:
        out = done[r.traj_id]
        vs = out.versions.tolist()
        assert vs == sorted(vs) and set(vs) <= {old, version}
        assert vs.count(old) == at_pull[r.traj_id]  # the tokens before the Pull, no more
        check_by_version(models, r, out, None if exact_after else [old])
    assert any(n > 0 for n in at_pull.values()), "no request decoded across the Pull"
    if backend.name == "vllm":  # one prompt was still being prefilled when the Pull came
        assert any(n == 0 for n in at_pull.values())
    for r in late:
        assert set(done[r.traj_id].versions.tolist()) == {version}
        check_by_version(models, r, done[r.traj_id])


def test_a_trajectory_interrupted_and_resumed_samples_the_tokens_of_a_straight_run(
    backend, eng
) -> None:
    """The tail race and a recovered trajectory need this: the same weights give the same
    tokens whatever ran beside it, however its prompt was split and wherever it was
    interrupted and resumed (here once mid-prefill on vLLM, once mid-response)."""
    tid = next(_ids)
    eng.submit([long_request(90, 256, traj_id=tid), long_request(50, 80)])
    straight = drain(eng)[tid]
    eng.submit([long_request(70, 120), long_request(90, 256, traj_id=tid)])
    eng.step()
    part = eng.interrupt([tid])[tid]  # vLLM: its prompt not even started (70 went first)
    for steps in (1, 57):
        eng.submit([long_request(90, 256, traj_id=tid, prefix=part), long_request(45, 60)])
        for _ in range(steps + 8):
            eng.step()
        part = eng.interrupt([tid])[tid]
        assert 0 < len(part.tokens) < 256
        assert part.tokens.tolist() == straight.tokens[: len(part.tokens)].tolist()
    eng.submit([long_request(90, 256, traj_id=tid, prefix=part)])
    resumed = drain(eng)[tid]
    assert resumed.tokens.tolist() == straight.tokens.tolist()
    np.testing.assert_allclose(resumed.logprobs, straight.logprobs, atol=TOL, rtol=0)


def test_a_copy_forked_at_any_token_samples_the_originals_tokens(backend, eng) -> None:
    """A race copy starts from the response its holder last reported, not where the
    original was submitted: it must continue with the original's tokens from any point."""
    tid = next(_ids)
    eng.submit([long_request(120, 200, traj_id=tid)])
    original = drain(eng)[tid]
    for k in (1, 131):
        fork = long_request(120, 200, traj_id=tid)
        given = GenerationRequest(
            tid,
            fork.prompt,
            original.tokens[:k].copy(),
            original.logprobs[:k].copy(),
            original.versions[:k].copy(),
            200,
        )
        eng.submit([given, long_request(64, 40), long_request(33, 40)])
        copy = drain(eng)[tid]
        assert copy.tokens.tolist() == original.tokens.tolist(), k
        np.testing.assert_allclose(copy.logprobs, original.logprobs, atol=TOL, rtol=0)
