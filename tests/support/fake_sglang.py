"""FAKE SGLang server, for tests only: SGLang cannot be installed on the CPU machines.

It reproduces the HTTP contract of **SGLang 0.5.23** (``python/sglang/srt/`` of the
released wheel; the routes and fields are cited where they are served) that
``staleflow.engines.sglang`` uses, over real HTTP on 127.0.0.1, and generates real tokens
with StaleFlow's embedded engine (``staleflow.engines.embedded``) on a ``transformers``
model. What it fakes: the server process, its scheduler and its weight updater. What it
enforces, because an adapter can get it wrong:

* ``/update_weights_from_tensor`` outside ``/begin_weight_update`` ...
  ``/end_weight_update`` fails (``managers/scheduler_components/weight_updater.py:236``);
  a second begin, or an end without begin, fails (``:309``, ``:323``);
* a weight update while requests are in flight and generation is not paused fails here
  (real SGLang would block until they all finished: ``model_update_lock``,
  ``managers/tokenizer_control_mixin.py:563``; the fake refuses rather than stall);
* a weight update with ``flush_cache`` fails when the flush is refused, i.e. when
  requests are running, or waiting while generation is not paused
  (``scheduler.py:5518``, ``weight_updater.py:119``): pausing ``in_place`` keeps them
  running, ``retract`` moves them to the queue;
* the tensor payload is read with an allow-list unpickler like SGLang's ``SafeUnpickler``
  (``utils/common.py:3144``), one payload per TP rank; ``load_format`` must be listed in
  ``custom_weight_loaders`` (``--custom-weight-loader``), and the loader is imported and
  called as ``loader(model, named_tensors)`` (``weight_updater.py:374``);
* ``/abort_request`` ends the ``/generate`` call with ``finish_reason.type == "abort"``
  and the tokens so far; ``/generate`` must carry the sampling settings the fake was
  started with (it has one sampler), ``input_ids`` and ``return_logprob``.

Seeds, as a server started with ``--enable-deterministic-inference`` (``deterministic``)
uses them: each token is drawn from the request's ``sampling_params.sampling_seed`` (42
when absent, ``sampling/sampling_batch_info.py:157``) and its position in prompt +
response (``layers/sampler.py`` ``multinomial_with_seed``), here by the embedded engine's
keyed sampler with the seed as its trajectory key and the position as its token index.
So a request resumed from any point, on any fake at the same weights, draws what one run
straight through would. What the fake does not model: batch-invariant kernels (the
embedded engine's logits do not depend on the batch anyway), and two requests with one
seed in flight on one server (refused here; real SGLang would run both). Without
``deterministic`` the seed is ignored, as SGLang ignores it.

With ``lora_rank`` (``--enable-lora``) it serves LoRA adapters (fake_sglang_lora.py).

Per-token versions are reported as SGLang does, ``meta_info.weight_versions`` spans of
string versions set by the ``weight_version`` of each update ("default" before the first).
"""

from __future__ import annotations

import base64
import importlib
import io
import itertools
import json
import pickle
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch

from staleflow.engines.base import EngineOutput, GenerationRequest
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

SGLANG_VERSION = "0.5.23"

# The globals an empty-tensor ticket (or any CPU tensor list) needs, all on
# SafeUnpickler.ALLOWED_GLOBALS in utils/common.py of 0.5.23.
_ALLOWED = {
    ("builtins", "list"),
    ("builtins", "tuple"),
    ("builtins", "str"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "uint8"),
    ("torch", "float32"),
    ("torch", "bfloat16"),
    ("torch.storage", "UntypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


class HTTPFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Generation:
    def __init__(
        self, rid: str, traj_id: int, ids: np.ndarray, max_new: int, deterministic: bool
    ) -> None:
        self.rid = rid
        self.traj_id = traj_id
        # Deterministic: the engine sees all input ids but the first as the response so far,
        # so its token index is the position the next token is drawn at, minus one.
        self.skip = len(ids) - 1 if deterministic else 0
        self.prompt = ids[: len(ids) - self.skip]
        self.prefix = ids[len(ids) - self.skip :]
        self.max_response = self.skip + max_new
        self.done = threading.Event()
        self.output: EngineOutput | None = None
        self.aborted = False
        self.retractions = 0
        self.lora: str | None = None  # the adapter it runs with (lora_path)


class _ModelShim:
    """What a custom loader gets as ``model``: ``load_weights(iterable of (name, tensor))``
    like SGLang's model classes (names are Hugging Face names)."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.loaded[name] = tensor


class FakeSGLangServer:
    """Serve ``model`` with the embedded engine behind SGLang 0.5.23's routes."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        temperature: float,
        top_p: float,
        eos_token_id: int | None,
        kv_budget_tokens: int = 4096,
        max_running: int = 16,
        max_seq_len: int = 256,
        seed: int = 0,
        deterministic: bool = False,
        tp_size: int = 1,
        custom_weight_loaders: tuple[str, ...] = (
            "staleflow.engines.sglang.loader.load_from_parameter_server",
        ),
        port: int = 0,
        lora_rank: int = 0,
        lora_targets: tuple[str, ...] = (),
    ) -> None:
        self.lora = None
        if lora_rank:  # --enable-lora: the model gets the adapter layers first
            from tests.support.fake_sglang_lora import FakeLoRA

            self.lora = FakeLoRA(model, lora_rank, lora_targets)
        self.engine = EmbeddedEngine(
            model,
            EmbeddedEngineConfig(
                kv_budget_tokens=kv_budget_tokens,
                max_running=max_running,
                max_seq_len=max_seq_len,
                temperature=temperature,
                top_p=top_p,
                eos_token_id=eos_token_id,
                seed=seed,
            ),
        )
        self.deterministic = deterministic
        self.tp_size = tp_size
        self.custom_weight_loaders = custom_weight_loaders
        self.weight_version = "default"
        self._version_labels: dict[int, str] = {0: "default"}
        self._next_version = itertools.count(1)
        self._lock = threading.Condition()
        self._gens: dict[int, _Generation] = {}
        self._ids = itertools.count()
        self._paused: str | None = None
        self._steps_allowed: int | None = None  # tests: None runs freely (see hold/allow)
        self._session = False
        self._stop = False
        self.calls: list[str] = []  # routes in the order they were called
        self._http = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._threads = [
            threading.Thread(target=self._http.serve_forever, daemon=True),
            threading.Thread(target=self._run, daemon=True),
        ]

    def start(self) -> FakeSGLangServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._http.shutdown()
        self._http.server_close()

    # -- the scheduler -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and (
                    self._paused or not self.engine.has_work or self._steps_allowed == 0
                ):
                    self._lock.wait()
                if self._stop:
                    return
                for out in self.engine.step():
                    gen = self._gens.pop(out.traj_id)
                    gen.output = out
                    gen.done.set()
                if self._steps_allowed is not None:
                    self._steps_allowed -= 1
                    self._lock.notify_all()

    # -- test controls (not SGLang): freeze the scheduler to make states happen ---------

    def hold(self) -> None:
        """Stop stepping until :meth:`allow` or :meth:`release`."""
        with self._lock:
            self._steps_allowed = 0

    def allow(self, steps: int, timeout: float = 30.0) -> None:
        """Run exactly ``steps`` more scheduler steps, and return once they ran."""
        with self._lock:
            self._steps_allowed = (self._steps_allowed or 0) + steps
            self._lock.notify_all()
            if not self._lock.wait_for(lambda: self._steps_allowed == 0, timeout):
                raise TimeoutError("the fake did not run the steps it was allowed")

    def release(self) -> None:
        with self._lock:
            self._steps_allowed = None
            self._lock.notify_all()

    def wait_for_requests(self, n: int, timeout: float = 30.0) -> None:
        """Return once ``n`` /generate calls are in flight here."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._gens) >= n, timeout):
                raise TimeoutError(f"{n} requests did not arrive")

    # -- routes --------------------------------------------------------------------------

    def route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        self.calls.append(path)
        try:
            if method == "GET":
                return 200, self._get(path)
            handler = {
                "/generate": self._generate,
                "/abort_request": self._abort_request,
                "/pause_generation": self._pause,
                "/continue_generation": self._continue,
                "/flush_cache": self._flush_cache,
                "/begin_weight_update": self._begin,
                "/end_weight_update": self._end,
                "/update_weights_from_tensor": self._update_from_tensor,
                "/update_weights_from_disk": self._update_from_disk,
                "/load_lora_adapter": lambda b: self._lora_route("load", b),
                "/unload_lora_adapter": lambda b: self._lora_route("unload", b),
            }.get(path)
            if handler is None:
                return 404, {"message": f"no route {path}"}
            return 200, handler(body)
        except HTTPFailure as exc:
            return exc.status, {"success": False, "message": str(exc)}

    def _get(self, path: str) -> Any:
        if path == "/health":
            return None
        if path == "/model_info":  # http_server.py:812
            return {"weight_version": self.weight_version}
        if path.startswith("/v1/loads"):  # v1_loads.py:96, load_snapshot.py:196
            with self._lock:
                state = self.engine.state()
                budget = self.engine.config.kv_budget_tokens
                return {
                    "version": SGLANG_VERSION,
                    "loads": [
                        {
                            "dp_rank": 0,
                            "num_running_reqs": len(state.running),
                            "num_waiting_reqs": len(state.waiting),
                            "num_used_tokens": state.kv_tokens,
                            "max_total_num_tokens": budget,
                            "token_usage": state.kv_tokens / budget,
                        }
                    ],
                }
        raise HTTPFailure(404, f"no route {path}")

    def _generate(self, body: dict[str, Any]) -> Any:  # http_server.py:928
        rid, ids = body.get("rid"), body.get("input_ids")
        if not isinstance(rid, str) or not isinstance(ids, list) or not ids:
            raise HTTPFailure(400, "fake: /generate needs a string rid and a list of input_ids")
        if not body.get("return_logprob"):
            raise HTTPFailure(400, "fake: /generate without return_logprob gives no logprobs")
        sp = body.get("sampling_params") or {}
        cfg = self.engine.config
        for key, want in (("temperature", cfg.temperature), ("top_p", cfg.top_p)):
            if float(sp.get(key, 1.0)) != float(want):
                raise HTTPFailure(
                    400, f"fake: sampling_params.{key}={sp.get(key)} but the fake samples {want}"
                )
        stops = sorted(sp.get("stop_token_ids") or ())
        if stops != sorted(cfg.eos_ids) or bool(sp.get("ignore_eos")) == bool(stops):
            raise HTTPFailure(
                400, f"fake: stop_token_ids={stops} but the fake stops at {cfg.eos_ids}"
            )
        max_new = int(sp.get("max_new_tokens", 128))
        seed = sp.get("sampling_seed")
        if seed is not None and (
            not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63
        ):  # sampling_params.py:302
            raise HTTPFailure(400, f"sampling_seed must be an integer, got {seed!r}")
        with self._lock:
            if self.deterministic:
                key = (42 if seed is None else seed) % 2**63
                if key in self._gens:
                    raise HTTPFailure(400, f"fake: two requests in flight with seed {key}")
            else:
                key = next(self._ids)
            input_ids = np.asarray(ids, dtype=np.int32)
            gen = _Generation(rid, key, input_ids, max_new, self.deterministic)
            n = len(gen.prefix)
            request = GenerationRequest(
                gen.traj_id,
                gen.prompt,
                gen.prefix,
                np.zeros(n, np.float32),
                np.zeros(n, np.int32),
                gen.max_response,
            )
            gen.lora = body.get("lora_path")
            self._lora_route("use", {"lora_path": gen.lora})
            try:
                self.engine.submit([request])
            except ValueError as exc:
                raise HTTPFailure(400, str(exc)) from exc
            self._gens[gen.traj_id] = gen
            self._lock.notify_all()
        gen.done.wait()
        return self._answer(gen, len(ids))

    def _answer(self, gen: _Generation, prompt_tokens: int) -> Any:
        out = gen.output
        assert out is not None
        tokens = out.tokens[gen.skip :].tolist()
        if gen.aborted:
            finish: dict[str, Any] | None = {"type": "abort", "message": "Abort before prefill"}
        elif out.finish_reason == "stop":
            finish = {"type": "stop", "matched": tokens[-1]}
        else:
            finish = {"type": "length", "length": len(tokens)}
        spans: list[dict[str, Any]] = []
        for i, v in enumerate(out.versions[gen.skip :].tolist()):
            label = self._version_labels[v]
            if spans and spans[-1]["version"] == label:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": label, "start": i, "end": i + 1})
        meta = {
            "id": gen.rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "num_retractions": gen.retractions,
            "weight_version": self.weight_version,
            "output_token_logprobs": [
                [lp, tok, None]
                for lp, tok in zip(out.logprobs[gen.skip :].tolist(), tokens, strict=True)
            ],
        }
        if spans:
            meta["weight_versions"] = spans
        return {"output_ids": tokens, "meta_info": meta}

    def _abort_request(self, body: dict[str, Any]) -> None:  # http_server.py:1721
        with self._lock:
            gens = (
                list(self._gens.values())
                if body.get("abort_all")
                else [g for g in self._gens.values() if g.rid == body.get("rid")]
            )
            parts = self.engine.interrupt([g.traj_id for g in gens])
            for g in gens:
                del self._gens[g.traj_id]
                g.aborted = True
                g.output = parts[g.traj_id]
                g.done.set()

    def _pause(self, body: dict[str, Any]) -> Any:  # http_server.py:1831, io_struct.py:1927
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise HTTPFailure(400, f"unknown pause mode {mode!r}")
        if mode == "abort":
            self._abort_request({"abort_all": True})
        with self._lock:
            self._paused = mode
            if mode == "retract":  # scheduler.py:5817: running requests back to the queue
                state = self.engine.state()
                order = [t for t, _ in state.running] + [t for t, _ in state.waiting]
                parts = self.engine.interrupt(order)
                for t, _ in state.running:
                    self._gens[t].retractions += 1
                self.engine.submit([self._resubmit(t, parts[t]) for t in order])
        return {"status": "ok"}

    def _resubmit(self, traj_id: int, part: EngineOutput) -> GenerationRequest:
        gen = self._gens[traj_id]
        return GenerationRequest(
            traj_id, gen.prompt, part.tokens, part.logprobs, part.versions, gen.max_response
        )

    def _continue(self, body: dict[str, Any]) -> Any:  # http_server.py:1844
        with self._lock:
            self._paused = None
            self._lock.notify_all()
        return {"status": "ok"}

    def _flushable(self) -> bool:
        state = self.engine.state()
        return not state.running and (self._paused is not None or not state.waiting)

    def _flush_cache(self, body: dict[str, Any]) -> Any:  # http_server.py:1025
        with self._lock:
            if not self._flushable():
                raise HTTPFailure(400, "Cache not flushed because there are pending requests.")
        return None

    def _begin(self, body: dict[str, Any]) -> Any:  # weight_updater.py:309
        with self._lock:
            if self._session:
                raise HTTPFailure(
                    400, "a weight-update session is already open; call end_weight_update() first"
                )
            self._session = True
        return {"success": True, "message": "Success"}

    def _end(self, body: dict[str, Any]) -> Any:  # weight_updater.py:323
        with self._lock:
            if not self._session:
                raise HTTPFailure(
                    400, "no weight-update session is open; call begin_weight_update() first"
                )
            self._session = False
        return {"success": True, "message": "Success"}

    def _check_update_allowed(self) -> None:
        if self._paused is None and self._gens:
            raise HTTPFailure(
                409,
                "fake: a weight update while requests are in flight and generation is not "
                "paused would wait for all of them to finish (model_update_lock)",
            )

    def _update_from_tensor(self, body: dict[str, Any]) -> Any:  # weight_updater.py:233
        payloads = body.get("serialized_named_tensors")
        load_format = body.get("load_format")
        with self._lock:
            if not self._session:
                raise HTTPFailure(
                    400,
                    "update_weights_from_tensor must run between begin_weight_update() and "
                    "end_weight_update()",
                )
            self._check_update_allowed()
            if not isinstance(payloads, list) or len(payloads) != self.tp_size:
                raise HTTPFailure(
                    400, f"serialized_named_tensors must hold {self.tp_size} payloads"
                )
            named = _SafeUnpickler(io.BytesIO(base64.b64decode(payloads[0]))).load()
            if load_format not in self.custom_weight_loaders:
                raise HTTPFailure(400, f"Unknown load_format={load_format}")
            module, _, attr = load_format.rpartition(".")
            shim = _ModelShim()
            getattr(importlib.import_module(module), attr)(shim, named)
            return self._apply(shim.loaded, body)

    def _update_from_disk(self, body: dict[str, Any]) -> Any:  # http_server.py:1300
        from safetensors.torch import load_file

        with self._lock:
            self._check_update_allowed()
            folder = Path(body["model_path"])
            weights: dict[str, torch.Tensor] = {}
            for file in sorted(folder.glob("*.safetensors")):
                weights.update(load_file(str(file)))
            return self._apply(weights, body)

    # -- LoRA (--enable-lora): tests/support/fake_sglang_lora.py --------------------------

    def _lora_route(self, route: str, body: dict[str, Any]) -> Any:
        from tests.support.fake_sglang_lora import lora_route

        return lora_route(self, route, body)

    def _apply(self, weights: dict[str, torch.Tensor], body: dict[str, Any]) -> Any:
        label = body.get("weight_version")
        version = next(self._next_version)
        try:
            if self.lora is not None:  # with adapters: the model's own weights, the base
                self.engine.load_base_weights(weights)
            else:
                self.engine.load_weights(weights, version)
        except ValueError as exc:
            raise HTTPFailure(400, f"Failed to update weights: {exc}") from exc
        if label is not None:
            self.weight_version = str(label)
        self._version_labels[version] = self.weight_version
        if body.get("flush_cache", True) and not self._flushable():
            raise HTTPFailure(
                400,
                "Weights were updated, but the cache was not flushed because requests are "
                "still running or queued. Retract or finish them, then call /flush_cache.",
            )
        return {"success": True, "message": "Success", "num_paused_requests": 0}


def _handler(server: FakeSGLangServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else {}
            except ValueError:
                status, payload = 400, {"message": "body is not JSON"}
            else:
                status, payload = server.route(method, urlsplit(self.path).path, body)
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.support.fake_sglang --model-path DIR --port N [other flags]``: the
    fake as a process, standing in for ``python -m sglang.launch_server`` (flags it does
    not know are ignored). Sampling settings come from the environment
    (``FAKE_SGLANG_TEMPERATURE``, ``FAKE_SGLANG_TOP_P``, ``FAKE_SGLANG_EOS``), because real
    SGLang takes them per request and the fake has one sampler."""
    import argparse
    import os
    import signal

    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--custom-weight-loader", nargs="*", default=[])
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    args, _ = parser.parse_known_args(argv)
    if os.environ.get("FAKE_SGLANG_FAIL_AT_START"):
        raise SystemExit(f"fake: failing at start-up as asked ({args.model_path})")
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_path).eval()
    eos = os.environ.get("FAKE_SGLANG_EOS")
    server = FakeSGLangServer(
        model,
        temperature=float(os.environ.get("FAKE_SGLANG_TEMPERATURE", "1.0")),
        top_p=float(os.environ.get("FAKE_SGLANG_TOP_P", "1.0")),
        eos_token_id=int(eos) if eos else None,
        custom_weight_loaders=tuple(args.custom_weight_loader),
        deterministic=args.enable_deterministic_inference,
        port=args.port,
    ).start()
    print(f"fake SGLang {SGLANG_VERSION} serving {args.model_path} at {server.url}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
