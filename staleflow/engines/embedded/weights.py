"""A weight update into the embedded engine's parameters: every tensor checked (names,
shapes, a floating dtype) before the first copy, so a bad update changes nothing."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from staleflow.engines.checks import check_weights


def copy_checked(params: Mapping[str, nn.Parameter], weights: Mapping[str, object]) -> None:
    """Copy ``weights`` (numpy arrays or tensors) into ``params``, all or nothing."""
    expected = {name: tuple(p.shape) for name, p in params.items()}
    tensors = {
        name: as_tensor(value, name) for name, value in check_weights(expected, weights).items()
    }
    # Everything is checked before the first copy, so a bad update changes nothing.
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)


def as_tensor(value: object, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach()
    elif isinstance(value, np.ndarray):
        arr = value if value.flags.writeable else value.copy()  # from_numpy wants writable
        t = torch.from_numpy(arr)
    else:
        raise ValueError(
            f"parameter {name!r}: expected a numpy array or tensor, got {type(value).__name__}"
        )
    if not t.is_floating_point():
        raise ValueError(f"parameter {name!r}: dtype {t.dtype} is not a floating type")
    return t
