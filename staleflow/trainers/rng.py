"""torch's random generators as a checkpoint keeps them (the CPU one and every CUDA
device's), for the trainers' parts of a run checkpoint (``docs/recovery.md``)."""

from __future__ import annotations

import torch


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{i}"] = s
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore ``state``; CUDA generators only where this process sees as many devices
    as the writer did (another GPU count re-seeds nothing and keeps its own)."""
    torch.set_rng_state(state["cpu"])
    cuda = [state[k] for k in sorted(state) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
