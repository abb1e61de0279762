"""Temperature / top-p sampling with counter-based randomness, and the logprobs we report.

Reported logprob: ``log_softmax(logits / T)[token]``, the log-probability of the sampled
token under the policy at temperature ``T``, *before* top-p truncation and renormalisation
(what the trainer's importance ratios compare against, since it recomputes
``log_softmax(logits / T)``). With ``T == 0`` (greedy) it is ``log_softmax(logits)``, the
untempered policy.

Randomness: token ``i`` of trajectory ``t`` is drawn by inverse-CDF sampling from one
uniform ``u = hash(seed, t, i)``, so draws do not depend on batch composition, submission
order, preemption or an interrupt/resume cycle: the same seed gives the same tokens as long
as the logits are the same (batched float math can still differ in the last bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    # uint64 array arithmetic wraps modulo 2**64 silently, which is what the mixer wants.
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniforms(seed: int, traj_ids: Sequence[int], indices: Sequence[int]) -> np.ndarray:
    """One float64 in [0, 1) per (trajectory, response index), a pure function of
    ``(seed, traj_id, index)``."""
    seed_key = np.array([seed], dtype=np.int64).view(np.uint64)
    ids = np.asarray(traj_ids, dtype=np.int64).view(np.uint64)
    idx = np.asarray(indices, dtype=np.int64).view(np.uint64)
    x = _splitmix(_splitmix(seed_key * _GOLDEN + ids) ^ (idx * _GOLDEN + _M1))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample(
    logits: torch.Tensor, u: torch.Tensor, *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[n]`` (int64) and their logprobs ``[n]`` (float32) for float32 ``logits``
    ``[n, vocab]`` and uniforms ``u`` ``[n]`` (ignored when greedy)."""
    if temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        cdf = probs.cumsum(dim=-1)
        # Smallest prefix whose mass reaches top_p: a token is kept while the mass before
        # it is below top_p (the most likely token always is).
        kept = ((cdf - probs) < top_p).sum(dim=-1)
    else:
        order = None
        cdf = probs.cumsum(dim=-1)
        kept = torch.full(
            (logits.shape[0],), logits.shape[1], dtype=torch.long, device=logits.device
        )
    mass = cdf.gather(1, (kept - 1)[:, None])
    # Keep the target strictly below the kept mass, so the first cdf entry above it is a
    # kept token of positive probability even when u * mass rounds up.
    target = torch.minimum(
        (u[:, None] * mass).to(cdf.dtype), torch.nextafter(mass, cdf.new_zeros(()))
    )
    pick = torch.searchsorted(cdf, target, right=True)
    pick = torch.minimum(pick, (kept - 1)[:, None])
    tokens = (order.gather(1, pick) if order is not None else pick)[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
