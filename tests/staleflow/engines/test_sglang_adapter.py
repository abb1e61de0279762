"""The SGLang adapter beyond the shared contract, against the fake SGLang 0.5.23 server
(tests/support/fake_sglang.py): the Pull where the server's TP ranks fetch a version from
a real parameter server, the server rules the fake enforces, and the launcher (a real
subprocess: health wait, death at start-up, death mid-run)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

from staleflow.engines.base import GenerationRequest
from staleflow.engines.sglang import (
    ParameterServerSource,
    ServerSpec,
    SGLangEngine,
    SGLangEngineConfig,
    SGLangError,
    SGLangHTTP,
    start_sglang_engine,
)
from tests.staleflow.engines.backends import (
    KV_BUDGET,
    MAX_SEQ,
    TEMPERATURE,
    TOP_P,
    VOCAB,
    build_model,
    drain,
    frequent_token,
    teacher_forced,
)
from tests.support.fake_sglang import FakeSGLangServer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sglang-model")
    build_model(0).save_pretrained(path)
    return path


def config(folder: Path, eos: int | None, **overrides) -> SGLangEngineConfig:
    kw = dict(
        kv_budget_tokens=KV_BUDGET,
        max_running=16,
        max_seq_len=MAX_SEQ,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        eos_token_id=eos,
        model_path=str(folder),
    )
    kw.update(overrides)
    return SGLangEngineConfig(**kw)


def fake(eos: int | None) -> FakeSGLangServer:
    return FakeSGLangServer(
        build_model(0), temperature=TEMPERATURE, top_p=TOP_P, eos_token_id=eos
    ).start()


def req(traj_id: int, max_response: int = 12) -> GenerationRequest:
    prompt = np.random.default_rng(traj_id).integers(0, VOCAB, size=6, dtype=np.int32)
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return GenerationRequest(traj_id, prompt, e_i, e_f, e_i, max_response)


def test_tp_ranks_pull_the_version_from_the_parameter_server(folder) -> None:
    from parameter_server import Layout
    from parameter_server.torch_compat import layout_of_state_dict
    from parameter_server.worker import PSWorker

    new = build_model(5)
    state = {n: p.detach().numpy().copy() for n, p in new.named_parameters()}
    layout: Layout = layout_of_state_dict({n: p.detach() for n, p in new.named_parameters()})
    eos = frequent_token(build_model(0))
    server = fake(eos)
    with PSWorker.start(layout, num_slots=2) as ps, ps.connect("shm") as client:
        client.push(state, 5)
        source = ParameterServerSource(
            {k: getattr(ps.endpoint, k) for k in ("address", "host", "boot_id", "region_name")},
            "shm",
            layout.to_dict(),
        )
        engine = SGLangEngine(SGLangHTTP(server.url), config(folder, eos), parameter_server=source)
        try:
            assert engine.pulls_from_parameter_server
            engine.submit([req(1, max_response=40)])  # in flight while the version loads
            engine.load_version(5)
            control = [c for c in server.calls if c not in ("/generate", "/v1/loads")]
            update = control[control.index("/pause_generation") :]
            assert update[:5] == [
                "/pause_generation",
                "/begin_weight_update",
                "/update_weights_from_tensor",
                "/end_weight_update",
                "/continue_generation",
            ]
            engine.submit([req(2)])
            done = drain(engine)
            assert sorted(done) == [1, 2], "the request in flight was dropped by the pull"
            assert set(done[2].versions.tolist()) == {5}
            ref = teacher_forced(new, req(2).prompt, done[2].tokens)
            np.testing.assert_allclose(done[2].logprobs, ref, atol=2e-5)
        finally:
            engine.close()
            server.stop()


def test_the_fake_enforces_the_rules_an_adapter_can_break(folder) -> None:
    eos = None  # length stops only: request 3 must still be running when it is interrupted
    server = fake(eos)
    http = SGLangHTTP(server.url)
    engine = SGLangEngine(http, config(folder, eos))
    try:
        with pytest.raises(SGLangError, match="must run between begin_weight_update"):
            http.post("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]})
        with pytest.raises(SGLangError, match="no weight-update session is open"):
            http.post("/end_weight_update", {})
        http.post("/begin_weight_update", {})
        with pytest.raises(SGLangError, match="already open"):
            http.post("/begin_weight_update", {})
        http.post("/end_weight_update", {})
        # an update while a request is in flight, generation not paused: refused
        server.hold()
        engine.submit([req(3, max_response=MAX_SEQ - 10)])
        server.wait_for_requests(1)
        weights = {n: p.detach().numpy() for n, p in build_model(1).named_parameters()}
        folder_v = engine._write_folder(weights, 1)
        body = {"model_path": str(folder_v), "weight_version": "1"}
        with pytest.raises(SGLangError, match="in flight and generation is not paused"):
            http.post("/update_weights_from_disk", body)
        # paused in place, a running request keeps its KV: the flush fails the update
        server.allow(1)  # admitted and decoding: running
        http.post("/pause_generation", {"mode": "in_place"})
        with pytest.raises(SGLangError, match="cache was not flushed"):
            http.post("/update_weights_from_disk", body)
        http.post("/continue_generation", {})
        # an abort returns the partial response (the fake still holds its scheduler)
        parts = engine.interrupt([3])
        server.release()
        assert 3 in parts and parts[3].finish_reason is None
        assert len(parts[3].tokens) == 1  # the one step it was allowed
    finally:
        engine.close()
        server.stop()


def _fake_python(tmp_path: Path, *, fail: bool = False) -> Path:
    """An "interpreter" that runs the fake for ``-m sglang.launch_server ...``."""
    script = tmp_path / "python-fake-sglang"
    script.write_text(
        "#!/bin/sh\nshift 2\n"  # drop "-m sglang.launch_server"
        + ("export FAKE_SGLANG_FAIL_AT_START=1\n" if fail else "")
        + f'exec {sys.executable} -m tests.support.fake_sglang "$@"\n',
        encoding="utf-8",
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _spec(
    tmp_path: Path,
    folder: Path,
    eos: int | None,
    *,
    fail: bool = False,
    deterministic: bool = False,
) -> ServerSpec:
    return ServerSpec(
        model_path=str(folder),
        log_path=str(tmp_path / "logs" / "instance-0.log"),
        python=str(_fake_python(tmp_path, fail=fail)),
        deterministic=deterministic,
        startup_timeout_s=120,
        env={
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "FAKE_SGLANG_TEMPERATURE": str(TEMPERATURE),
            "FAKE_SGLANG_TOP_P": str(TOP_P),
            "FAKE_SGLANG_EOS": "" if eos is None else str(eos),
        },
    )


def test_a_trajectory_samples_the_same_tokens_wherever_and_whenever_it_resumes(
    tmp_path, folder
) -> None:
    """What lets launch run the tail race on SGLang (``rollout.sglang.deterministic``):
    every request is seeded by its trajectory and a deterministic server draws by (seed,
    position), so a trajectory stopped on one server and resumed on another continues as
    one run straight through would, and another trajectory with the same prompt samples
    its own tokens. One server is a subprocess started from ``ServerSpec`` (the flag on
    its command line), the other in process."""
    spec = _spec(tmp_path, folder, None, deterministic=True)
    assert "--enable-deterministic-inference" in spec.argv(1)
    assert "--enable-deterministic-inference" not in _spec(tmp_path, folder, None).argv(1)
    a = start_sglang_engine(spec, config(folder, None))
    b_server = FakeSGLangServer(
        build_model(0), temperature=TEMPERATURE, top_p=TOP_P, eos_token_id=None, deterministic=True
    ).start()
    b = SGLangEngine(SGLangHTTP(b_server.url), config(folder, None))
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    prompt = req(7).prompt

    def run(engine: SGLangEngine, r: GenerationRequest) -> np.ndarray:
        engine.submit([r])
        return drain(engine)[r.traj_id]

    try:
        whole = run(a, GenerationRequest(7, prompt, e_i, e_f, e_i, 24))
        assert len(whole.tokens) == 24
        first = run(b, GenerationRequest(7, prompt, e_i, e_f, e_i, 9))  # stops at 9 tokens
        resumed = GenerationRequest(7, prompt, first.tokens, first.logprobs, first.versions, 24)
        assert run(a, resumed).tokens.tolist() == whole.tokens.tolist()
        other = run(b, GenerationRequest(8, prompt, e_i, e_f, e_i, 24))
        assert other.tokens.tolist() != whole.tokens.tolist(), "requests are not seeded"
    finally:
        a.close()
        b.close()
        b_server.stop()


def test_a_server_that_dies_at_start_up_is_reported_with_its_log(tmp_path, folder) -> None:
    eos = frequent_token(build_model(0))
    with pytest.raises(
        SGLangError, match=r"exited with code 1 while starting(.|\n)*failing at start-up"
    ):
        start_sglang_engine(_spec(tmp_path, folder, eos, fail=True), config(folder, eos))


def test_a_server_dying_mid_run_stops_its_instance_with_an_error_naming_it(
    tmp_path, folder
) -> None:
    from staleflow.rollout.instance import RolloutInstance

    eos = frequent_token(build_model(0))
    engine = start_sglang_engine(_spec(tmp_path, folder, eos), config(folder, eos))
    engine.submit([req(4)])
    assert 4 in drain(engine)  # real tokens through a real server process
    log = Path(tmp_path / "logs" / "instance-0.log")
    assert "fake SGLang 0.5.23 serving" in log.read_text()
    instance = RolloutInstance(7, engine, max_response=MAX_SEQ - 10, on_finished=lambda f: None)
    instance.start()
    from trajectory_server.types import RoutedTrajectory

    r = req(5, max_response=MAX_SEQ - 10)
    e_i = np.zeros(0, np.int32)
    instance.submit([RoutedTrajectory(5, 0, 0, 0, "", r.prompt, e_i, np.zeros(0, np.float32), e_i)])
    os.killpg(engine._on_close.__self__.pid, 9)
    instance._thread.join(60)
    assert not instance._thread.is_alive(), "the instance did not notice its server died"
    with pytest.raises(RuntimeError, match=r"rollout instance 7 stopped(.|\n)*exited with code"):
        instance.check()
    instance.stop()


class _LateAbortServer:
    """A server that, as SGLang 0.5.23 did under CI's launch, answers an abort that
    arrived after the request's last token was sampled with ``finish_reason`` "abort"
    and the whole response."""

    base_url = "http://late-abort.invalid"

    def __init__(self, tokens: list[int]) -> None:
        import threading

        self.tokens = tokens
        self.aborted = threading.Event()

    def post(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        if path == "/abort_request":
            self.aborted.set()
            return {}
        assert path == "/generate"
        assert self.aborted.wait(30)
        return {
            "output_ids": self.tokens,
            "meta_info": {
                "id": body["rid"],
                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                "prompt_tokens": len(body["input_ids"]),
                "output_token_logprobs": [[-1.0, t, None] for t in self.tokens],
            },
        }


def test_an_abort_answered_after_the_last_token_is_a_completion(folder) -> None:
    """Resubmitting such a response is refused ("it is finished, do not resubmit it"), so
    the adapter reports it finished: by length at max_response, by the stop token."""
    for tokens, eos, reason in (([5, 6, 7], None, "length"), ([5, 9], 9, "stop")):
        server = _LateAbortServer(tokens)
        engine = SGLangEngine(server, config(folder, eos))  # type: ignore[arg-type]
        try:
            engine.submit([req(1, max_response=3)])
            assert engine.interrupt([1]) == {}  # not a partial response
            (done,) = drain(engine).values()
            assert done.tokens.tolist() == tokens and done.finish_reason == reason
        finally:
            engine.close()
