"""What megatron-core 0.16.1 needs to run on a CPU (gloo), applied only when CUDA is absent.

Each patch was shown necessary on these machines (docs/training.md): without it the
first forward or the model's construction fails with "Torch not compiled with CUDA
enabled". They touch the process they run in only, which on CPU is a dedicated trainer
rank process.

1. ``torch.cuda.current_device`` returns ``"cpu"``: the rotary embedding moves its
   frequencies to that device (``models/common/embeddings/rotary_pos_embedding.py``).
2. ``initialize_rng_tracker(inference_rng_tracker=True)``: the dropout RNG ``fork()``
   becomes a no-op instead of reading the CUDA RNG state
   (``tensor_parallel/random.py``). Dropout is 0 in RL training, so nothing is lost.
3. ``get_default_causal_mask`` builds its mask on the CPU: the original creates it with
   ``device="cuda"`` (``transformer/utils.py``, imported by ``fusions/fused_softmax.py``).
4. ``torch.cuda.synchronize`` does nothing: distributed checkpointing calls it before
   writing (``dist_checkpointing/strategies/filesystem_async.py``); there is nothing to
   wait for on a CPU.
"""

from __future__ import annotations

import functools

import torch


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@functools.cache
def apply_cpu_patches() -> bool:
    """Patch megatron-core for CPU if CUDA is absent; True if patched. Idempotent; call
    before building a model."""
    if torch.cuda.is_available():
        return False
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    cached = functools.lru_cache(maxsize=8)(_cpu_causal_mask)
    transformer_utils.get_default_causal_mask = cached
    fused_softmax.get_default_causal_mask = cached
    tp_random.initialize_rng_tracker(inference_rng_tracker=True)
    return True
