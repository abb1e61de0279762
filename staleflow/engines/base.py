"""The rollout-engine contract (DESIGN.md: ``RolloutEngine``), shared by every backend.

An engine is a plain, single-threaded object driven by its instance wrapper
(``staleflow.rollout``): the wrapper calls :meth:`RolloutEngine.step` in a loop and the
control methods between steps, so engines need no locks. Token arrays are 1-D ``int32``,
logprobs ``float32``, per-token policy versions ``int32``, all of one length, as in the
trajectory server (``trajectory_server.types``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

FINISH_STOP = "stop"  # the model emitted EOS (or a stop token)
FINISH_LENGTH = "length"  # the response reached its token budget


@dataclass(frozen=True, slots=True, eq=False)
class GenerationRequest:
    """Generate after ``prompt + tokens`` until EOS or ``len(response) == max_response``.

    ``tokens``/``logprobs``/``versions`` hold the response so far: empty for a fresh
    trajectory, the partial response for one resumed after an interrupt or preemption
    (the engine re-prefills ``prompt + tokens`` and keeps the given logprobs and versions
    for those tokens).

    ``traj_id`` is a trajectory's id, or, from ``EVAL_ID_BASE`` (2**62) on, a held-out
    evaluation request of the instance (``staleflow.rollout.eval_lane``): an engine treats
    both alike, so it must take any non-negative int64 id.

    ``group_id``: the trajectory's group (its siblings answer the same prompt), for an
    engine that drafts speculative tokens from the group (``staleflow.engines.drafts``);
    None: not in a group (evaluation), or unknown. Engines without speculation ignore it.

    ``draft_method``: this request's draft method (``group``, ``own`` or ``off``,
    ``staleflow.engines.drafts.METHODS``) instead of the engine's, e.g. a race copy of a
    straggler drafting otherwise than its original (SpecActor's fastest-of-N over draft
    methods); None: the engine's. Every method samples the same tokens; engines without
    speculation ignore it.
    """

    traj_id: int
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    max_response: int
    group_id: int | None = None
    draft_method: str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class EngineOutput:
    """A trajectory leaving the engine: finished (``finish_reason`` set) or interrupted
    (``finish_reason`` None). Arrays cover the whole response so far, including what the
    request came in with."""

    traj_id: int
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the engine knows of the §5.2 snapshot fields.

    ``kv_tokens``: tokens held in the KV cache now. ``running``: ids in the running batch
    with their current length (prompt + response so far); ``waiting``: queued ids, head
    first, with their lengths; waiting requests hold no KV cache. ``version``: the policy
    version of the loaded weights. ``preemptions``: requests the engine has pushed back to
    its queue to free KV cache, since it started. ``kv_usage``: the fraction of the engine's
    own KV cache in use, where the engine reports one (vLLM, SGLang), else None.
    """

    kv_tokens: int
    running: tuple[tuple[int, int], ...]
    waiting: tuple[tuple[int, int], ...]
    version: int
    preemptions: int = 0
    kv_usage: float | None = None


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Cumulative seconds an engine spent in each phase (Table 3), and tokens produced.

    ``prefix_hits``: requests whose prefix KV was reused instead of prefilled (a turn
    coming back to the instance that ran the one before, or vLLM's prefix cache);
    ``prefix_tokens``: the tokens not prefilled thanks to that. An engine that cannot tell
    reports 0; vLLM reports its cache's hit tokens (its hits per request are not known:
    ``prefix_hits`` stays 0 there)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefix_hits: int = 0
    prefix_tokens: int = 0


class RolloutEngine(Protocol):
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests at the back of the waiting queue, in order. Raises ``ValueError``
        (naming the trajectory) for a duplicate id or malformed arrays, changing nothing."""
        ...

    def step(self) -> list[EngineOutput]:
        """Admit waiting requests while the KV budget allows (prefill), preempting running
        ones back into the queue when the budget is exceeded, then decode one token for
        every running request (an engine verifying speculative drafts may add several).
        Returns the requests that finished in this step. A no-op returning [] when there is
        no work."""
        ...

    def interrupt(self, traj_ids: Iterable[int]) -> dict[int, EngineOutput]:
        """Remove running or waiting requests and return their partial responses.
        Unknown ids (finished, aborted, never submitted) are absent from the result."""
        ...

    def abort(self, traj_ids: Iterable[int]) -> list[int]:
        """Drop requests for good; returns the ids that were running or waiting."""
        ...

    def load_weights(self, weights: Mapping[str, object], version: int) -> None:
        """Load named parameters (numpy arrays or tensors, the names and shapes of
        :meth:`weight_shapes`) as policy ``version``. Running and waiting requests stay;
        tokens generated from now on carry ``version``."""
        ...

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Parameter name -> (shape, dtype name) that :meth:`load_weights` expects."""
        ...

    def state(self) -> EngineState: ...

    def times(self) -> StepTimes: ...

    @property
    def has_work(self) -> bool: ...

    def close(self) -> None:
        """Release what the engine holds outside this process (a server, threads)."""
        ...


class SelfPullingEngine(RolloutEngine, Protocol):
    """An engine whose workers fetch weights from the parameter server themselves (SGLang's
    TP ranks through a custom weight loader): the instance tells it which version to load
    instead of handing it the weights."""

    def load_version(self, version: int) -> None:
        """Load ``version`` from the parameter server; same guarantees as ``load_weights``."""
        ...


class ReportsProgress(Protocol):
    """An engine that can say what it generated so far without stopping anything. The
    instance reports it to the TS every few seconds (``rollout.progress_every_s``), so a
    lost instance costs only the tokens since the last report (``docs/recovery.md``)."""

    def progress(self) -> dict[int, EngineOutput]:
        """The whole response so far of every running and waiting request, with
        ``finish_reason`` None. Only tokens that stay in the response: a later interrupt
        or finish must start with them."""
        ...


class KeepsPrefixes(Protocol):
    """An engine that keeps a finished turn's KV for the trajectory's next turn and can
    list what it keeps (the embedded engine's prefix store). The instance reports the list
    in its snapshots (``InstanceSnapshot.held``, ``held_exact``), so the coordinator's KV
    locality reads what is held, evictions included, and the control plane frees an ended
    episode's prefix at once. vLLM's and SGLang's caches are keyed by token blocks, not by
    trajectory: for them the control plane assumes (``runtime/controller/tool_view.py``)."""

    def held_prefixes(self) -> tuple[int, ...]:
        """Trajectories whose prefix is kept, least recently kept first."""
        ...

    def held_prefix_sizes(self) -> tuple[tuple[int, int], ...]:
        """(trajectory, tokens kept) in :meth:`held_prefixes`' order."""
        ...

    def drop_prefixes(self, traj_ids: Iterable[int]) -> list[int]:
        """Forget the prefixes of ``traj_ids``; returns those that were kept."""
        ...
