"""The frozen reference policy of the KL term (``trainer.kl_coef``, ``trainer.ref``).

A reference is a second copy of the policy's weights that never trains: the initial
policy by default, or a Hugging Face model folder (``trainer.ref.path``) of the policy's
architecture. Each trained batch is scored by it once, in a no-grad forward pass
(:func:`staleflow.trainers.rl.with_reference`): its logprobs of the trained tokens travel
with the sequences into the loss, like the proximal ones.

What it costs: the reference's weights in memory (no gradients, no optimizer state:
about a quarter of what the policy's training holds with AdamW in float32) and one
forward pass without autograd per step, about a third of a forward + backward. The
benchmark ``experiments/bench_ref_kl.py`` measures the step time with the KL on and off.

The embedded trainer holds it in its process (:class:`DenseReference`); a Megatron rank
holds its own TP/PP shard of it, built like the policy's
(``staleflow.trainers.megatron.rank.MegatronRank.init_reference``).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch

from parameter_server.torch_compat import to_numpy
from staleflow.models.state import load_policy_state, policy_state
from staleflow.trainers.rl import LocalReduce, SingleStage, dense_token_stats

logger = logging.getLogger(__name__)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` that never trains (no gradients, eval mode)."""
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return ref


def reference_weights(path: str | Path) -> dict[str, np.ndarray]:
    """The weights of the model folder ``path`` by :func:`staleflow.models.policy_state`
    name (the names the parameter server and the Megatron converter use), in float32."""
    from transformers import AutoModelForCausalLM

    p = Path(path).expanduser()
    model = AutoModelForCausalLM.from_pretrained(str(p), torch_dtype=torch.float32)
    logger.info("loaded the reference policy from %s", p)
    return {name: to_numpy(t).copy() for name, t in policy_state(model).items()}


def load_reference(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """A frozen copy of ``model`` with the weights of the model folder ``path``; the
    architectures must match (``ModelError`` names the parameters that do not)."""

    ref = frozen_copy(model)
    load_policy_state(ref, reference_weights(path))
    return ref


class DenseReference(SingleStage, LocalReduce):
    """A :class:`staleflow.trainers.rl.StepBackend` (forward passes only) of a whole
    reference model in one process."""

    token_stats = staticmethod(dense_token_stats)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits

    def zero_grad(self) -> None:  # frozen: nothing to update
        pass

    def update(self) -> float:
        raise RuntimeError("the reference policy is frozen")
