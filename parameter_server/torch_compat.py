"""Optional torch <-> numpy bridges for trainers and engines. Imports torch lazily.

No copy is made for CPU tensors: the numpy array shares the tensor's memory.
bfloat16 travels as its uint16 bit pattern (the layout dtype stays 'bfloat16').
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parameter_server.layout import Layout, ParamSpec, dtype_name


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "torch is needed for parameter_server.torch_compat; it is part of StaleFlow's "
            "default install: `pip install -c constraints.txt -e .` in the checkout"
        ) from exc
    return torch


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy view of ``tensor`` (moved to CPU and made contiguous first if needed)."""
    torch = _torch()
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def state_dict_to_numpy(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {name: to_numpy(t) for name, t in state_dict.items()}


def layout_of_state_dict(state_dict: Mapping[str, Any], alignment: int = 64) -> Layout:
    """The layout of a torch state dict, keeping bfloat16 as 'bfloat16'."""
    specs = []
    for name, t in state_dict.items():
        dtype = str(t.dtype).removeprefix("torch.")
        specs.append(ParamSpec(name, tuple(t.shape), dtype_name(dtype)))
    return Layout(specs, alignment)


def from_numpy(array: np.ndarray, dtype: str) -> Any:
    """A torch tensor sharing ``array``'s memory, reinterpreted as layout dtype ``dtype``."""
    torch = _torch()
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def views_to_torch(layout: Layout, buffer: np.ndarray) -> dict[str, Any]:
    """Name -> torch tensor views into a packed buffer (e.g. a Pull destination)."""
    return {
        name: from_numpy(view, layout.spec(name).dtype)
        for name, view in layout.views(buffer).items()
    }
