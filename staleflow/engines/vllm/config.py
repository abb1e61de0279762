"""Settings of the vLLM rollout engine (in process, step driven)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staleflow.engines.settings import EngineSettings, positive_int


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig(EngineSettings):
    """:class:`~staleflow.engines.settings.EngineSettings` plus vLLM's own.

    model_path: a local Hugging Face checkpoint folder (``config.json`` and weights): the
        architecture, and the weights until the first Pull. Its tokenizer is not used:
        requests are token ids.
    kv_budget_tokens: vLLM's KV cache is sized to exactly this many tokens (rounded up to
        whole blocks), so the coordinator's cost model and the engine agree on ``M``.
    tensor_parallel_size: GPUs per instance (1 on CPU).
    gpu_memory_utilization: passed to vLLM on GPU; ignored on CPU.
    dtype: ``float32`` (default: logprobs match a float32 trainer), ``bfloat16``, ``float16``
        or ``auto`` (vLLM may pick a half type for a float32 checkpoint).
    block_size: KV-cache block (page) size in tokens; vLLM's CPU attention needs a
        multiple of 32.
    enable_prefix_caching: reuse KV of shared prefixes (a group's prompt, a resumed
        response). The cache is reset at every weight load, so no stale entry is reused.
    extra_args: more ``vllm.EngineArgs`` fields, e.g. ``{"max_num_batched_tokens": 4096}``.
    lora_rank, lora_alpha, lora_targets: with ``lora_rank`` > 0 (``trainer.lora``) every
        version is a LoRA adapter of that rank, alpha and target modules over the model
        folder's weights (:mod:`staleflow.engines.vllm.lora`); ``lora_dir`` is where the
        adapter folders go (empty: a temporary folder).
    log_path: file that vLLM's own log (the ``vllm`` loggers, in every vLLM process, and
        the Python warnings raised while it starts) goes to, warnings and errors only;
        empty: vLLM's default, INFO and up on stdout. ``launch`` sets
        ``<run folder>/vllm/instance-<i>.log``.
    """

    model_path: str = ""
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    dtype: str = "float32"
    block_size: int = 32
    enable_prefix_caching: bool = True
    extra_args: dict[str, Any] = field(default_factory=dict)
    log_path: str = ""
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_dir: str = ""

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        folder = Path(self.model_path) if self.model_path else None
        if folder is None or not (folder / "config.json").is_file():
            raise ValueError(
                f"model_path={self.model_path!r} is not a Hugging Face checkpoint folder (no "
                "config.json): give the folder vLLM loads the architecture from"
            )
        positive_int("tensor_parallel_size", self.tensor_parallel_size, "GPUs per instance")
        positive_int("block_size", self.block_size, "KV-cache block size in tokens")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: use auto, float32, bfloat16 or float16")
        if self.lora_rank and not (self.lora_alpha > 0 and self.lora_targets):
            raise ValueError(
                "lora_rank > 0 needs lora_alpha > 0 and lora_targets (the adapter's scale is "
                "alpha / rank, over the named modules)"
            )
