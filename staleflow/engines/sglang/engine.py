"""SGLang behind the rollout-engine contract: an HTTP client of one SGLang server.

Built on SGLang 0.5.23's HTTP API (paths under ``python/sglang/srt/``):

* generate: ``POST /generate`` (``entrypoints/http_server.py:928``) with
  ``GenerateReqInput`` fields (``managers/io_struct.py:177``) ``rid``, ``input_ids``,
  ``sampling_params`` (``sampling/sampling_params.py:140``: ``max_new_tokens``,
  ``temperature``, ``top_p``, ``stop_token_ids``, ``ignore_eos``, ``no_stop_trim``,
  ``sampling_seed``),
  ``return_logprob``, ``logprob_start_len=-1`` (output tokens only). The answer has
  ``output_ids`` and ``meta_info`` (``managers/tokenizer_manager.py:2507-2569``):
  ``finish_reason.type`` (stop / length / abort), ``output_token_logprobs`` as
  ``[logprob, token_id, text]`` triples (``:2869``), ``prompt_tokens``,
  ``cached_tokens``, ``num_retractions``, and ``weight_versions``, spans
  ``{version, start, end}`` over the output tokens (``utils/weight_versions.py:90``),
  which give each token its policy version.
* interrupt / abort: ``POST /abort_request {rid}`` (``http_server.py:1721``); the aborted
  ``/generate`` returns ``finish_reason.type == "abort"`` with the tokens so far. A resumed
  trajectory is a new ``/generate`` over ``prompt + response`` (the radix cache holds the
  prefix while the weights are unchanged).
* weights, between ``POST /pause_generation {"mode": "retract"}`` and
  ``POST /continue_generation`` (``:1831``, ``:1844``): retract moves running requests
  back to the queue with their KV dropped (``managers/scheduler.py:5817``), so they are
  kept and recomputed under the new weights, and the update's cache flush succeeds
  (``scheduler.py:5518`` ignores the waiting queue while paused); without the pause the
  update would wait for every in-flight request (``model_update_lock``,
  ``managers/tokenizer_control_mixin.py:563``). Then either
  ``/begin_weight_update`` + ``/update_weights_from_tensor`` (our PS loader in every TP
  rank, :mod:`staleflow.engines.sglang.loader`) + ``/end_weight_update`` (a tensor update
  outside a session fails, ``managers/scheduler_components/weight_updater.py:236``), or
  ``/update_weights_from_disk`` from a RAM-backed folder. ``weight_version`` is set on the
  update, so the spans carry our version numbers; ``flush_cache=true`` drops the radix
  cache the old weights computed (a refused flush fails the update, ``:119``).
* LoRA (``lora_rank``): each version is a new adapter, ``POST /load_lora_adapter
  {lora_name, lora_path}`` from a folder under ``disk_dir``, and every ``/generate``
  names it (``lora_path``, ``managers/io_struct.py:277``). SGLang unloads an adapter only
  once no request uses it (``tokenizer_control_mixin.py:651``), so the engine interrupts
  the requests in flight, resubmits them under the new adapter (their tokens so far
  carry the old version), then ``POST /unload_lora_adapter {lora_name}`` the old one. A
  version's tokens are those of the adapter a request was submitted under (no
  ``weight_versions`` spans: the base never changes). The base loads once, by the disk
  path.
* load: ``GET /v1/loads?include=core`` (``entrypoints/v1_loads.py:96``,
  ``managers/load_snapshot.py:196``): ``num_running_reqs``, ``token_usage``.

Each in-flight ``/generate`` is a blocking call on its own thread; :meth:`step` collects
the calls that returned. SGLang lists no running request ids, so the snapshot takes the
first ``num_running_reqs`` in-flight requests (submission order) as running, and a
request's length is known only up to its last return (prompt + response at submission).
"""

from __future__ import annotations

import itertools
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from staleflow.engines.adapters import AdapterFolders, AdapterSpec
from staleflow.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    EngineState,
    GenerationRequest,
    StepTimes,
)
from staleflow.engines.checkpoint import read_checkpoint
from staleflow.engines.checks import CheckedRequest, check_request, check_unique, check_weights
from staleflow.engines.sglang.config import SGLangEngineConfig
from staleflow.engines.sglang.http import SGLangError, SGLangHTTP
from staleflow.engines.sglang.loader import LOADER_PATH, PullTicket, ticket_payloads

logger = logging.getLogger(__name__)

_ABORT = "abort"


@dataclass(eq=False)
class _Call:
    req: CheckedRequest
    rid: str
    adapter: tuple[str, int] | None = None  # LoRA: (name, version) it was submitted under
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    interrupted: bool = False


@dataclass(frozen=True, slots=True)
class ParameterServerSource:
    """Where the TP ranks pull from: a PS endpoint (``Endpoint`` as a dict), transport and
    layout (``Layout.to_dict()``)."""

    endpoint: dict[str, str]
    transport: str
    layout: dict[str, Any]


class SGLangEngine:
    """A :class:`~staleflow.engines.base.RolloutEngine` (and, with a ``parameter_server``
    and ``weight_sync="tensor"``, a ``SelfPullingEngine``) over one SGLang server.

    Every request carries ``sampling_seed``, the run's seed keyed by trajectory. A server
    started with ``--enable-deterministic-inference`` (``ServerSpec.deterministic``) draws
    each token from that seed and the token's position in prompt + response, with
    batch-invariant kernels (``layers/sampler.py`` ``multinomial_with_seed``, fed
    ``forward_batch.positions`` at ``model_executor/model_runner.py:2161``; the seeds are
    read only in that mode, ``sampling/sampling_batch_info.py:157``). A trajectory then
    samples the same tokens on any instance at the same weights and after any resume,
    which the tail race needs (``staleflow/runtime/controller/races.py``). Other servers ignore it.

    ``server_alive`` (optional) tells whether the server process still runs, so that a
    failed call can say the server died; ``on_close`` runs at :meth:`close` (stopping a
    server the caller started).
    """

    def __init__(
        self,
        client: SGLangHTTP,
        config: SGLangEngineConfig,
        *,
        version: int = 0,
        parameter_server: ParameterServerSource | None = None,
        server_alive: Callable[[], str | None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self._client = client
        self._checkpoint = read_checkpoint(config.model_path)
        self._ps = parameter_server
        self._server_alive = server_alive
        self._on_close = on_close
        self._initial_version = self._version = int(version)
        self._calls: dict[int, _Call] = {}  # in flight, submission order
        self._returned: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._ready: list[EngineOutput] = []  # finished while an interrupt waited on them
        self._rids = itertools.count()
        self._disk_version: Path | None = None
        self._retractions = 0
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._prefill_tokens = self._decode_tokens = 0
        self._prefill_s = 0.0
        self._lora: AdapterFolders | None = None
        self._adapter: tuple[str, int, Path] | None = None  # (name, version, folder) in use
        if config.lora_rank:
            spec = AdapterSpec(config.lora_rank, config.lora_alpha, tuple(config.lora_targets))
            self._adapter_shapes = spec.shapes(self._checkpoint)
            root = Path(config.disk_dir) / f"staleflow-lora-{id(self):x}"
            self._lora = AdapterFolders(spec, str(root))
        self.adapters = self._lora is not None

    loads_adapters = True  # with lora_rank: a version is a LoRA adapter (module doc)

    @property
    def pulls_from_parameter_server(self) -> bool:
        # with LoRA the instance hands it each adapter (load_weights)
        return self._ps is not None and self.config.weight_sync == "tensor" and not self.adapters

    # ----------------------------------------------------------------- requests in / out

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        checked = [
            check_request(
                r, vocab_size=self._checkpoint.vocab_size, max_seq_len=self.config.max_seq_len
            )
            for r in requests
        ]
        check_unique(checked, self._calls)
        adapter = None if self._adapter is None else self._adapter[:2]
        for req in checked:
            call = _Call(req, f"traj-{req.traj_id}-{next(self._rids)}", adapter)
            self._calls[req.traj_id] = call
            threading.Thread(
                target=self._generate, args=(call,), name=f"sglang-{call.rid}", daemon=True
            ).start()
        if self._calls and self._busy_since is None:
            self._busy_since = time.monotonic()

    def _generate(self, call: _Call) -> None:
        cfg, req = self.config, call.req
        eos = list(cfg.eos_ids)
        body = {
            "rid": call.rid,
            "input_ids": req.prompt.tolist() + req.tokens.tolist(),
            "sampling_params": {
                "max_new_tokens": req.max_response - len(req.tokens),
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "stop_token_ids": eos or None,
                "ignore_eos": not eos,
                "no_stop_trim": True,  # keep the stop token, as every engine here does
                "skip_special_tokens": False,
                # Used only by a server with --enable-deterministic-inference, which draws
                # each token from (seed, position): a trajectory then samples the same
                # tokens on any instance and after any resume (class doc).
                "sampling_seed": cfg.request_seed(req.traj_id),
            },
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        if call.adapter is not None:
            body["lora_path"] = call.adapter[0]  # the name it was loaded under
        try:
            call.result = self._client.post("/generate", body, timeout_s=cfg.request_timeout_s)
        except BaseException as exc:  # reported by step() or interrupt()
            call.error = exc
        call.done.set()
        self._returned.put(call)

    def interrupt(self, traj_ids: Iterable[int]) -> dict[int, EngineOutput]:
        calls = self._take(traj_ids)
        for call in calls:
            self._abort_call(call)
        out: dict[int, EngineOutput] = {}
        for call in calls:
            self._wait_aborted(call)
            output = self._output(call)
            if output.finish_reason is None:
                out[call.req.traj_id] = output
            else:  # it finished before the abort reached it: a completion after all
                self._ready.append(output)
        return out

    def abort(self, traj_ids: Iterable[int]) -> list[int]:
        calls = self._take(traj_ids)
        for call in calls:
            self._abort_call(call)
        return [c.req.traj_id for c in calls]

    def _take(self, traj_ids: Iterable[int]) -> list[_Call]:
        calls = [self._calls.pop(t) for t in dict.fromkeys(traj_ids) if t in self._calls]
        for call in calls:
            call.interrupted = True
        self._update_busy()
        return calls

    def _abort_call(self, call: _Call) -> None:
        if not call.done.is_set():
            self._client.post("/abort_request", {"rid": call.rid})

    def _wait_aborted(self, call: _Call) -> None:
        # An abort that reaches the server before the request does is ignored
        # (tokenizer_manager.py:2241): repeat it until the call returns.
        deadline = time.monotonic() + 60.0
        while not call.done.wait(0.5):
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise SGLangError(
                    f"SGLang server {self._client.base_url} did not end request {call.rid} "
                    "within 60 s of /abort_request"
                )
            self._client.post("/abort_request", {"rid": call.rid})

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[EngineOutput]:
        finished, self._ready = self._ready, []
        if not self._calls:
            return finished
        try:
            returned = [self._returned.get(timeout=self.config.poll_s)]
        except queue.Empty:
            self._raise_if_dead()
            return finished
        while True:
            try:
                returned.append(self._returned.get_nowait())
            except queue.Empty:
                break
        for call in returned:
            if call.interrupted or self._calls.get(call.req.traj_id) is not call:
                continue  # taken by interrupt/abort, which handles its result
            del self._calls[call.req.traj_id]
            output = self._output(call)
            if output.finish_reason is None:
                raise SGLangError(
                    f"SGLang server {self._client.base_url} aborted request {call.rid} "
                    f"(trajectory {call.req.traj_id}) on its own: "
                    f"{call.result['meta_info']['finish_reason']}"
                )
            finished.append(output)
        self._update_busy()
        return finished

    def _output(self, call: _Call) -> EngineOutput:
        if call.error is not None:
            # a refused or reset connection usually means the server died: give its exit a
            # moment to show, so the error says so (with the log's tail)
            self._raise_if_dead(wait_s=5.0)
            raise SGLangError(f"trajectory {call.req.traj_id}: {call.error}") from call.error
        result, req = call.result, call.req
        meta = result["meta_info"]
        ids = [int(t) for t in result["output_ids"]]
        triples = meta.get("output_token_logprobs") or []
        if [int(t[1]) for t in triples] != ids:
            raise SGLangError(
                f"request {call.rid}: output_token_logprobs do not match output_ids "
                f"({len(triples)} logprobs for {len(ids)} tokens)"
            )
        if call.adapter is not None:  # LoRA: the adapter's version, the base never changes
            versions = np.full(len(ids), call.adapter[1], dtype=np.int32)
        else:
            versions = self._token_versions(meta, len(ids))
        reason = (meta.get("finish_reason") or {}).get("type")
        self._retractions += int(meta.get("num_retractions") or 0)
        self._prefill_tokens += int(meta.get("prompt_tokens", 0)) - int(
            meta.get("cached_tokens", 0)
        )
        self._decode_tokens += len(ids)
        total = len(req.tokens) + len(ids)
        complete = total >= req.max_response or bool(ids and ids[-1] in self.config.eos_ids)
        if reason == _ABORT and not complete:
            finish = None
        # An abort that reaches the scheduler after the request's last token was sampled
        # still answers "abort" (seen on SGLang 0.5.23): the response is complete all the
        # same, and a resubmission of it would be refused, so it finishes here.
        elif reason == FINISH_STOP or (ids and ids[-1] in self.config.eos_ids):
            finish = FINISH_STOP
        elif reason in (FINISH_LENGTH, _ABORT) or total >= req.max_response:
            finish = FINISH_LENGTH
        else:
            raise SGLangError(f"request {call.rid}: unexpected finish_reason {reason!r}")
        return EngineOutput(
            traj_id=req.traj_id,
            tokens=np.concatenate([req.tokens, np.asarray(ids, dtype=np.int32)]),
            logprobs=np.concatenate(
                [req.logprobs, np.asarray([t[0] for t in triples], dtype=np.float32)]
            ),
            versions=np.concatenate([req.versions, versions]),
            finish_reason=finish,
        )

    def _token_versions(self, meta: Mapping[str, Any], n: int) -> np.ndarray:
        versions = np.full(n, self._version_of(meta.get("weight_version")), dtype=np.int32)
        for span in meta.get("weight_versions") or ():
            versions[int(span["start"]) : int(span["end"])] = self._version_of(span["version"])
        return versions

    def _version_of(self, label: object) -> int:
        # Versions we set are decimal; the server's own label before our first update
        # ("default") is the version the engine was built with.
        text = str(label)
        return int(text) if text.lstrip("-").isdigit() else self._initial_version

    def _raise_if_dead(self, wait_s: float = 0.0) -> None:
        if self._server_alive is None:
            return
        deadline = time.monotonic() + wait_s
        while True:
            why = self._server_alive()
            if why:
                raise SGLangError(why)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _update_busy(self) -> None:
        now = time.monotonic()
        if self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = now if self._calls else None
        elif self._calls:
            self._busy_since = now

    # ----------------------------------------------------------------------------- weights

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if self._lora is not None:
            return dict(self._adapter_shapes)
        return dict(self._checkpoint.shapes)

    def base_weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """With LoRA, the model folder's weights (the base under the adapters); else empty."""
        return dict(self._checkpoint.shapes) if self._lora is not None else {}

    def load_base_weights(self, weights: Mapping[str, object]) -> None:
        """With LoRA, load the frozen base (once) by the disk path; the version stays."""
        if self._lora is None:
            raise ValueError(
                "load_base_weights: this SGLang engine serves full weights (lora_rank=0); "
                "load_weights takes them"
            )
        self._load_from_disk(weights, self._version)

    def load_weights(self, weights: Mapping[str, object], version: int) -> None:
        """Write the weights to a RAM-backed folder and load them with
        ``/update_weights_from_disk`` (the fallback Pull). With LoRA, ``weights`` is the
        adapter: a new one per version, the requests in flight moved to it (module doc)."""
        if self._lora is not None:
            self._switch_adapter(weights, version)
        else:
            self._load_from_disk(weights, version)
        self._version = int(version)

    def _switch_adapter(self, weights: Mapping[str, object], version: int) -> None:
        assert self._lora is not None
        expected = {name: shape for name, (shape, _) in self._adapter_shapes.items()}
        name, _, folder = self._lora.write(dict(check_weights(expected, weights)), version)
        try:
            self._client.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        except BaseException:
            self._lora.remove(folder)
            raise
        old, self._adapter = self._adapter, (name, int(version), folder)
        reqs = {t: c.req for t, c in self._calls.items()}
        moved = self.interrupt(list(reqs))  # their tokens so far: the old adapter's
        self.submit(
            [
                GenerationRequest(
                    t, reqs[t].prompt, o.tokens, o.logprobs, o.versions, reqs[t].max_response
                )
                for t, o in moved.items()
            ]
        )
        if old is not None:
            self._client.post("/unload_lora_adapter", {"lora_name": old[0]})
            self._lora.remove(old[2])

    def _load_from_disk(self, weights: Mapping[str, object], version: int) -> None:
        expected = {name: shape for name, (shape, _) in self._checkpoint.shapes.items()}
        folder = self._write_folder(check_weights(expected, weights), version)
        body = {
            "model_path": str(folder),
            "weight_version": str(version),
            "flush_cache": True,
            "abort_all_requests": False,
        }
        self._paused_update(lambda: self._client.post("/update_weights_from_disk", body))
        old, self._disk_version = self._disk_version, folder
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def load_version(self, version: int) -> None:
        """Have every TP rank pull ``version`` from the parameter server (our custom weight
        loader inside a begin/end weight-update session)."""
        if self._ps is None:
            raise RuntimeError("load_version needs the engine's parameter_server source")
        ticket = PullTicket(self._ps.endpoint, self._ps.transport, self._ps.layout, int(version))
        body = {
            "serialized_named_tensors": ticket_payloads(ticket, self.config.tp_size),
            "load_format": LOADER_PATH,
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": str(version),
        }

        def update() -> None:
            self._client.post("/begin_weight_update", {})
            try:
                self._client.post("/update_weights_from_tensor", body)
            finally:
                self._client.post("/end_weight_update", {})

        self._paused_update(update)
        self._version = int(version)

    def _paused_update(self, update: Callable[[], object]) -> None:
        self._client.post("/pause_generation", {"mode": "retract"})
        try:
            update()
        finally:
            self._client.post("/continue_generation", {"torch_empty_cache": True})

    def _write_folder(self, weights: Mapping[str, object], version: int) -> Path:
        import torch
        from safetensors.torch import save_file

        base = Path(self.config.disk_dir) / f"staleflow-{id(self):x}"
        folder = base / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        shutil.copy(Path(self.config.model_path) / "config.json", folder / "config.json")
        tensors = {
            name: (v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)))
            .detach()
            .contiguous()
            for name, v in weights.items()
        }
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    # ------------------------------------------------------------------------ observation

    def state(self) -> EngineState:
        load = (self._client.get("/v1/loads?include=core").get("loads") or [{}])[0]
        n_running = int(load.get("num_running_reqs", 0))
        calls = [(t, len(c.req.prompt) + len(c.req.tokens)) for t, c in self._calls.items()]
        running, waiting = tuple(calls[:n_running]), tuple(calls[n_running:])
        return EngineState(
            kv_tokens=sum(n for _, n in running),
            running=running,
            waiting=waiting,
            version=self._version,
            preemptions=self._retractions,
            kv_usage=float(load["token_usage"]) if "token_usage" in load else None,
        )

    def times(self) -> StepTimes:
        # The server reports no per-phase clock: busy time (a call in flight) counts as
        # decode; prefill_s stays 0 and the token counts come from meta_info.
        busy = self._busy_s + (
            time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        )
        return StepTimes(
            prefill_s=self._prefill_s,
            decode_s=busy,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
        )

    @property
    def has_work(self) -> bool:
        return bool(self._calls or self._ready)

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        calls = list(self._calls.values())
        self._calls.clear()
        try:
            if calls:
                self._client.post("/abort_request", {"abort_all": True}, timeout_s=10.0)
        except SGLangError as exc:  # the server is already gone: nothing left to abort
            logger.debug("abort_all at close failed: %s", exc)
        finally:
            if self._disk_version is not None:
                shutil.rmtree(self._disk_version.parent, ignore_errors=True)
            if self._lora is not None:
                self._lora.close()
            if self._on_close is not None:
                self._on_close()
