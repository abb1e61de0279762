"""The :class:`staleflow.trainers.rl.StepBackend` of one Megatron rank.

Its logits are this rank's slice of the (padded) vocabulary, ``[batch, seq, V_pad / tp]``;
logprobs and entropies are computed across the tensor-parallel group without gathering
the vocabulary: the logprob with Megatron's ``vocab_parallel_cross_entropy`` (checked
against a full ``log_softmax`` to 1e-6), the entropy with three all-reduces (max, sum of
exponentials, their weighted sum). The rows that pad the vocabulary to a multiple of the
TP size are masked out, so the distribution is the Hugging Face model's exactly.

With pipeline parallelism (``pipeline``: the stage's model), the micro-batches go through
Megatron's non-interleaved 1F1B schedule (``get_forward_backward_func``): every stage
runs its layers on each micro-batch, activations and their gradients travel between
stages, and the last stage hands its logits to the shared loss
(:func:`staleflow.trainers.rl.micro_loss`); what it computes there reaches the other
stages with :meth:`VocabParallelBackend.from_last_stage`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from staleflow.trainers.megatron.cpu_patches import cpu_devices
from staleflow.trainers.rl import MicroBatch, MicroFn, ReduceOp, SingleStage

if TYPE_CHECKING:
    from staleflow.trainers.megatron.optim import CpuUpdate, MegatronUpdate

_T = TypeVar("_T")

# Far below any real logit, yet finite: exp() of it is 0 and 0 * it is 0 (with -inf
# the entropy's p * log p would be NaN).
_MASKED = -1e30

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class VocabParallelBackend(SingleStage):
    """Forward, token statistics and reductions of one rank; ``update`` is the rank's
    optimizer step (:mod:`staleflow.trainers.megatron.optim`); ``pipeline`` the stage's
    model (the one Megatron's schedule runs) when there is more than one stage."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        vocab_size: int,
        padded_vocab: int,
        tp_rank: int,
        tp_size: int,
        tp_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup,
        device: torch.device,
        update: CpuUpdate | MegatronUpdate,
        pipeline: torch.nn.Module | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self._forward = forward
        self.vocab_size = vocab_size  # the HF vocabulary: what token ids may be
        per_rank = padded_vocab // tp_size
        start = tp_rank * per_rank
        # this rank's columns that lie beyond the real vocabulary
        self._padding = torch.arange(start, start + per_rank, device=device) >= vocab_size
        self._any_padding = bool(self._padding.any())
        self._tp_group, self._dp_group = tp_group, dp_group
        self._device = device
        self._update = update
        self._pipeline, self._pp_group = pipeline, pp_group

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self._device)
        return self._forward(ids, self._positions(ids))

    def _positions(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.arange(ids.shape[1], device=self._device).unsqueeze(0).expand_as(ids)

    def forward_backward(
        self, mbs: Sequence[MicroBatch], fn: MicroFn, *, forward_only: bool
    ) -> None:
        if self._pipeline is None:
            super().forward_backward(mbs, fn, forward_only=forward_only)
            return
        from megatron.core.pipeline_parallel import get_forward_backward_func

        model = self._pipeline

        def forward_step(
            data: Iterator[int], stage_model: torch.nn.Module
        ) -> tuple[torch.Tensor, Any]:
            i = next(data)
            ids = mbs[i].ids.to(self._device)
            # a stage after the first takes its input from the previous stage (the
            # schedule sets it); the ids give the shape and the rotary positions
            output = stage_model(ids, self._positions(ids), None)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                loss = fn(i, logits)
                if loss is None:
                    loss = logits.new_zeros(())
                # (loss, tokens, reported): with calculate_per_token_loss the schedule
                # neither divides the loss (already over the global token count) nor
                # scales it by the number of micro-batches
                return loss, torch.ones((), dtype=torch.int), {}

            return output, loss_func

        first = mbs[0].ids
        with cpu_devices(), torch.no_grad() if forward_only else nullcontext():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(range(len(mbs))),
                model=[model],
                num_microbatches=len(mbs),
                seq_length=int(first.shape[1]),  # each one's shape travels before it
                micro_batch_size=int(first.shape[0]),
                forward_only=forward_only,
            )

    def from_last_stage(self, value: _T) -> _T:
        if self._pipeline is None:
            return value
        box = [value]
        last = dist.get_global_rank(self._pp_group, dist.get_world_size(self._pp_group) - 1)
        dist.broadcast_object_list(box, src=last, group=self._pp_group)
        return box[0]

    def token_stats(
        self, scaled_logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = scaled_logits
        if self._any_padding:
            logits = logits.masked_fill(self._padding, _MASKED)
        with torch.no_grad():
            entropy = self._entropy(logits.detach())
        # vocab_parallel_cross_entropy overwrites its input with the softmax: hand it a
        # tensor of its own; it wants [seq, batch, vocab / tp]
        loss = vocab_parallel_cross_entropy(
            logits.clone().unsqueeze(1), targets.to(self._device).unsqueeze(1)
        )
        return (-loss.squeeze(1)).cpu(), entropy.cpu()

    def _entropy(self, logits: torch.Tensor) -> torch.Tensor:
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self._tp_group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        sums = torch.stack((exp.sum(-1), (exp * shifted).sum(-1)))
        dist.all_reduce(sums, group=self._tp_group)
        total, weighted = sums[0], sums[1]
        return total.log() - weighted / total

    def zero_grad(self) -> None:
        self._update.zero_grad()

    def update(self) -> float:
        return self._update.step()

    def scale_grads(self, factor: float) -> None:
        self._update.scale_grads(factor)

    def reduce(self, values: np.ndarray, op: ReduceOp) -> np.ndarray:
        if dist.get_world_size(self._dp_group) == 1:
            return values
        t = torch.as_tensor(np.asarray(values, dtype=np.float64), device=self._device)
        dist.all_reduce(t, op=_OPS[op], group=self._dp_group)
        return t.cpu().numpy()
