"""The update of a Megatron rank: reduce gradients over data-parallel ranks, clip by the
global norm, take the optimizer step.

On CPU, Megatron's own optimizers do not run (``optimizer/optimizer.py`` and
``clip_grads.py`` create CUDA tensors; ``DistributedOptimizer`` wants CUDA parameters), so
:class:`CpuUpdate` is ``torch.optim.AdamW`` with a hand-made clip whose norm is summed
over the tensor- and pipeline-parallel ranks: a per-rank clip scales each rank's shard
differently and the replicated layernorms drift apart. With tied embeddings split across
pipeline stages, the first stage's embedding and the last stage's copy of it get the sum
of their two gradients (what Megatron's ``finalize_model_grads`` does on GPU), so the two
copies stay equal; the copy is counted once in the norm. The norm and clip follow
``torch.nn.utils.clip_grad_norm_`` (the embedded trainer's), so TP = 1 matches it.

On GPU, :class:`MegatronUpdate` wraps the model in Megatron's DistributedDataParallel,
finalizes the gradients with ``finalize_model_grads`` and uses ``get_megatron_optimizer`` (mixed precision with fp32 main weights, the distributed
optimizer, Megatron's clip). It needs CUDA and has not run in this project's CI.

Both call ``before_update`` first: the fence of the background Push, which reads the
live weights and must finish before they change. It comes before the first collective of
the update, so no rank passes that collective (and no rank starts the next version's
Push) before every rank's Push of this version is done.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from staleflow.config.sections import TrainerConfig
from staleflow.trainers.rl import adamw

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

logger = logging.getLogger(__name__)

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class CpuUpdate:
    """AdamW over this rank's parameters, gradients summed over ``dp_group``."""

    def __init__(
        self,
        model: torch.nn.Module,
        section: TrainerConfig,
        *,
        dp_group: dist.ProcessGroup,
        mp_group: dist.ProcessGroup,
        embedding_group: dist.ProcessGroup | None = None,
        before_update: Callable[[], None],
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, section)
        self._max_norm = section.max_grad_norm
        self._dp_group, self._mp_group = dp_group, mp_group
        # the first stage's tied embedding or the last stage's copy of it
        self._tied = (
            [p for p in self.params if getattr(p, "shared_embedding", False)]
            if embedding_group is not None
            else []
        )
        self._embedding_group = embedding_group
        self._before_update = before_update

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def scale_grads(self, factor: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def step(self) -> float:
        self._before_update()
        grads = []
        for p in self.params:
            if p.grad is None:  # a rank without tokens in this mini-batch
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if dist.get_world_size(self._dp_group) > 1:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self._dp_group)
            for g, reduced in zip(
                grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
            ):
                g.copy_(reduced)
        for p in self._tied:
            dist.all_reduce(p.grad, group=self._embedding_group)
        norm = self._global_norm()
        if math.isfinite(norm):
            coef = min(self._max_norm / (norm + _CLIP_EPS), 1.0)
            torch._foreach_mul_(grads, coef)
            self.optimizer.step()
        else:
            logger.warning("gradient norm %s; skipping the update", norm)
        self.zero_grad()
        return norm

    def _global_norm(self) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        own = [
            torch.linalg.vector_norm(p.grad.float())
            for p in self.params
            if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)
        ]
        square = torch.stack(own).square().sum() if own else torch.zeros(())
        square = square.to(torch.float64)
        dist.all_reduce(square, group=self._mp_group)
        return float(square.sqrt())

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()


class MegatronUpdate:
    """Megatron's DDP and optimizer (GPU only)."""

    def __init__(
        self, model: GPTModel, section: TrainerConfig, *, before_update: Callable[[], None]
    ) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = model.config
        self.module = model
        self.model = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=True,
                average_in_collective=False,
            ),
            module=model,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=section.lr,
                min_lr=section.lr,
                weight_decay=section.weight_decay,
                adam_beta1=section.adam_beta1,
                adam_beta2=section.adam_beta2,
                clip_grad=section.max_grad_norm,
                bf16=config.bf16,
                fp16=config.fp16,
                params_dtype=config.params_dtype,
                use_distributed_optimizer=True,
            ),
            [self.model],
        )
        self._before_update = before_update

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def scale_grads(self, factor: float) -> None:
        self.model.scale_gradients(factor)  # DDP's gradient buffers, before finalize

    def step(self) -> float:
        from megatron.core.distributed import finalize_model_grads

        self._before_update()
        # the data-parallel reduction, and with pipeline stages the sum of the tied
        # embedding's two gradients; no token count: the loss is already divided by it
        finalize_model_grads([self.model], num_tokens=None)
        ok, norm, _ = self.optimizer.step()
        self.zero_grad()
        return float(norm) if ok and norm is not None else float("nan")

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()
