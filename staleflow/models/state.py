"""The policy's named weights, as the parameter server and the rollout engines see them.

Names are those of ``model.named_parameters()``, which lists a tied tensor once (under its
first name, e.g. ``model.embed_tokens.weight``, not ``lm_head.weight``): every tensor
travels once per push and loading it updates every module sharing it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from staleflow.models.errors import ModelError

PolicyState = dict[str, torch.Tensor]


def policy_state(model: torch.nn.Module) -> PolicyState:
    """Name -> parameter tensor, tied weights once.

    The tensors are detached views of the live weights, not copies: copy them before the
    next optimizer step if they must stay fixed (``EmbeddedTrainer.export_weights`` does).
    """
    return {name: p.detach() for name, p in model.named_parameters()}


def _as_tensor(name: str, value: object, like: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == np.uint16 and like.dtype == torch.bfloat16:
            # the parameter server carries bfloat16 as its uint16 bit pattern
            return torch.from_numpy(np.ascontiguousarray(value).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(value))
    raise ModelError(f"parameter {name!r}: expected a numpy array or a tensor, got {type(value)}")


def load_policy_state(model: torch.nn.Module, state: Mapping[str, object]) -> None:
    """Copy ``state`` (numpy arrays or tensors by :func:`policy_state` names) into the model.

    Checks every name and shape before copying anything, so a mismatch leaves the model
    unchanged; the error names the offending parameter. Values are cast to each
    parameter's dtype.
    """
    load_parameters(dict(model.named_parameters()), state)


def load_parameters(params: Mapping[str, torch.Tensor], state: Mapping[str, object]) -> None:
    """:func:`load_policy_state` into ``params`` (name -> parameter), checked the same way:
    exactly these names, their shapes, floating point."""
    missing = [name for name in params if name not in state]
    unexpected = [name for name in state if name not in params]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        raise ModelError("the weights do not match the model's parameters: " + "; ".join(parts))
    tensors: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        tensor = _as_tensor(name, state[name], param)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelError(
                f"parameter {name!r}: shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(param.shape)}"
            )
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise ModelError(f"parameter {name!r}: dtype {tensor.dtype} is not floating point")
        tensors[name] = tensor
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])
