"""The :class:`staleflow.trainers.rl.StepBackend` of one Megatron rank.

Its logits are this rank's slice of the (padded) vocabulary, ``[batch, seq, V_pad / tp]``;
logprobs and entropies are computed across the tensor-parallel group without gathering
the vocabulary: the logprob with Megatron's ``vocab_parallel_cross_entropy`` (checked
against a full ``log_softmax`` to 1e-6), the entropy with three all-reduces (max, sum of
exponentials, their weighted sum). The rows that pad the vocabulary to a multiple of the
TP size are masked out, so the distribution is the Hugging Face model's exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from staleflow.trainers.rl import ReduceOp

# Far below any real logit, yet finite: exp() of it is 0 and 0 * it is 0 (with -inf
# the entropy's p * log p would be NaN).
_MASKED = -1e30

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class VocabParallelBackend:
    """Forward, token statistics and reductions of one rank; ``update`` is the rank's
    optimizer step (:mod:`staleflow.trainers.megatron.optim`)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        vocab_size: int,
        padded_vocab: int,
        tp_rank: int,
        tp_size: int,
        tp_group: Any,
        dp_group: Any,
        device: torch.device,
        update: Any,
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

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self._device)
        positions = torch.arange(ids.shape[1], device=self._device).unsqueeze(0).expand_as(ids)
        return self._forward(ids, positions)

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

    def reduce(self, values: np.ndarray, op: ReduceOp) -> np.ndarray:
        if dist.get_world_size(self._dp_group) == 1:
            return values
        t = torch.as_tensor(np.asarray(values, dtype=np.float64), device=self._device)
        dist.all_reduce(t, op=_OPS[op], group=self._dp_group)
        return t.cpu().numpy()
