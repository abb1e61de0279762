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

Pipeline parallelism needs two more, scoped to the calls that need them
(:func:`cpu_devices`), not patched process-wide:

5. The 1F1B schedule creates its token counter with ``device="cuda"``
   (``pipeline_parallel/schedules.py:2138``, ``forward_backward_pipelining_without_
   interleaving``), and building a model whose last stage holds a copy of tied
   embeddings moves that copy with ``weight.data.cuda()`` before the all-reduce between
   first and last stage (``models/common/language_module/language_module.py:244``).
   Inside :func:`cpu_devices`, a ``"cuda"`` device becomes the CPU and ``Tensor.cuda``
   returns the tensor itself. The stage-to-stage sends themselves (``p2p_communication.py``:
   ``batch_isend_irecv`` of isend/irecv pairs, shapes first with variable sequence
   lengths) run on gloo as they are, with patches 1 and 4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


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


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class _CpuDevices(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU and makes ``Tensor.cuda`` the identity."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextmanager
def cpu_devices() -> Iterator[None]:
    """Patch 5 of the module docstring, for the duration of the block; nothing on a
    machine with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    with _CpuDevices():
        yield
