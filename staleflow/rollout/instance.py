"""One rollout instance: an engine, the thread that steps it, and what the coordinator sees.

The engine is single-threaded; :class:`RolloutInstance` runs it on its own generation
thread and applies control calls (submit, interrupt, abort, weight loads) between steps
under one lock, as SGLang's scheduler does between forward passes. A finished trajectory
leaves through ``on_finished`` (the reward path) outside the lock, and stays listed in the
snapshot's ``complete_trajs`` until the next Pull, which is what the coordinator's
speculative state (Eq. 1) counts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from coordinator.seer import chunk_cap
from coordinator.types import InstanceSnapshot, TrajRecord
from staleflow.engines.base import FINISH_LENGTH, EngineOutput, GenerationRequest, RolloutEngine
from staleflow.engines.drafts import SpeculationStats
from staleflow.rollout.eval_lane import EvalLane, EvalOutput, EvalRequest
from staleflow.rollout.step_lock import StepLock
from trajectory_server.types import (
    InstanceId,
    PartialTrajectory,
    RewardTask,
    RoutedTrajectory,
    extend_mask,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True, eq=False)
class Finished:
    """A trajectory that finished generating, on its way to a reward worker: what the
    worker needs to score it (the TS's own record of it) and the instance that generated
    it (-1: unknown, a trajectory the TS handed a worker again). Its ``task.env_state``
    is not read: the environment stage reads a trajectory's state from the TS."""

    task: RewardTask
    instance: int


@dataclass(frozen=True, slots=True)
class InstanceTimes:
    """Cumulative seconds and counts of one instance (Table 3's rollout columns)."""

    busy_s: float  # generating (engine steps with work)
    idle_s: float  # no work
    prefill_s: float
    decode_s: float
    prefill_tokens: int
    decode_tokens: int
    load_s: float  # loading pulled weights into the engine
    finished: int
    # Seconds the engine was held by each command (Table 3), not counting the wait for
    # the decode step in progress: only this time is lost to generation.
    command_s: dict[str, float] = field(default_factory=dict)
    # trajectories handed back to the TS at a chunk boundary (divided rollout)
    chunks: int = 0
    # requests whose prefix KV the engine reused, and the tokens it did not prefill for
    # them (staleflow.engines.base.StepTimes)
    prefix_hits: int = 0
    prefix_tokens: int = 0
    # the engine's verified drafts (docs/speculation.md), all and per draft method; None: off
    speculation: SpeculationStats | None = None
    speculation_by_method: dict[str, SpeculationStats] | None = None


@dataclass(frozen=True, slots=True)
class CopyEnd:
    """How a race copy ended on its instance: its response tokens, and whether the TS took
    its completion (it finished first)."""

    tokens: int
    won: bool


@dataclass(slots=True)
class _Meta:
    group_id: int
    v_traj: int
    sample_id: int
    answer: str
    prompt: np.ndarray
    # the loss mask of the response the trajectory came in with; what the engine adds
    # after it is the model's own (True): the engine never sees a mask
    mask: np.ndarray


class RolloutInstance:
    """Drive ``engine`` on a thread; see the module docstring.

    ``max_response``: the response budget of every trajectory. ``on_finished`` receives
    finished trajectories in the order they finished; an exception it raises stops the
    instance (reported by :meth:`check`), because a lost completion would stall training.

    ``chunk_tokens`` (divided rollout, ``coordinator.seer``): a route lets the engine add
    at most this many tokens (the request's ``max_response`` is cut to the chunk's end,
    ``coordinator.seer.chunk_cap``); a request that stops there for length before its real
    budget goes to ``on_chunk`` as a partial, like an interrupted one, and stays listed
    among the trajectories that left since the last Pull (Eq. 1 counts it).

    ``eval_running``: evaluation requests (:mod:`staleflow.rollout.eval_lane`) in the
    engine at once at most; they are no trajectories of this instance.
    """

    def __init__(
        self,
        inst: int,
        engine: RolloutEngine,
        *,
        max_response: int,
        on_finished: Callable[[list[Finished]], None],
        clock: Callable[[], float] = time.monotonic,
        chunk_tokens: int | None = None,
        on_chunk: Callable[[list[PartialTrajectory]], None] | None = None,
        on_copy_finished: Callable[[list[tuple[Finished, InstanceId]]], Collection[int]]
        | None = None,
        eval_running: int = 16,
    ) -> None:
        if max_response < 1:
            raise ValueError(f"max_response={max_response}; use at least 1 token")
        if chunk_tokens is not None and (chunk_tokens < 1 or on_chunk is None):
            raise ValueError(
                f"chunk_tokens={chunk_tokens} needs to be >= 1 and an on_chunk callback"
            )
        self._chunk_tokens = chunk_tokens
        self._on_chunk = on_chunk
        self._chunks = 0
        self.inst = inst
        self._engine = engine
        self._max_response = max_response
        self._on_finished = on_finished
        self._clock = clock
        self._lock = StepLock()
        self._work = self._lock.work
        self._meta: dict[int, _Meta] = {}
        # race copies here (SpecActor's tail race, runtime/controller/races.py) -> their holder's id:
        # in the engine's batch, but not trajectories of this instance (hidden from
        # snapshot(), held() and progress())
        self._copies: dict[int, InstanceId] = {}
        # copies that ended here on their own (finished, or dropped by a Pull): response
        # tokens and whether the TS took the copy's completion (it won); drop_copies reports
        self._copy_ends: dict[int, CopyEnd] = {}
        self._on_copy_finished = on_copy_finished
        self._eval = EvalLane(max_response, eval_running)
        self._completed: list[int] = []  # since the last Pull
        self._busy_s = self._idle_s = self._load_s = 0.0
        self._command_s: dict[str, float] = defaultdict(float)
        self._finished = 0
        self._failure: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"instance {self.inst} already started")
        self._thread = threading.Thread(target=self._run, name=f"rollout-{self.inst}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        close = getattr(self._engine, "close", None)  # engines holding a server or threads
        if close is not None:
            close()

    def check(self) -> None:
        """Raise if the generation thread died (the error says why)."""
        if self._failure is not None:
            raise RuntimeError(
                f"rollout instance {self.inst} stopped: {self._failure!r}"
            ) from self._failure

    # -- commands (any thread) ---------------------------------------------------------

    def submit(self, routed: Sequence[RoutedTrajectory]) -> None:
        """Start generating trajectories handed out by the TS (queued behind the rest)."""
        requests = [
            GenerationRequest(
                traj_id=r.traj_id,
                prompt=r.prompt,
                tokens=r.tokens,
                logprobs=r.logprobs,
                versions=r.versions,
                max_response=chunk_cap(len(r.tokens), self._max_response, self._chunk_tokens),
                group_id=r.group_id,  # an engine with grouped drafts drafts from its siblings
            )
            for r in routed
        ]
        with self._lock:
            started = self._clock()
            self.check()
            # the original itself arrives where its copy runs: the copy gives way
            self._copy_ends.update(
                self._drop_copies_locked([r.traj_id for r in routed if r.traj_id in self._copies])
            )
            dup = [r.traj_id for r in routed if r.traj_id in self._meta]
            if dup:
                raise ValueError(f"instance {self.inst} already holds trajectories {dup}")
            self._engine.submit(requests)
            for r in routed:
                self._meta[r.traj_id] = _meta(r)
            self._work.notify_all()
            self._command_s["route"] += self._clock() - started

    def interrupt(self, traj_ids: Iterable[int]) -> dict[int, PartialTrajectory]:
        """Stop trajectories and return their partial responses (absent: already finished)."""
        with self._lock:
            started = self._clock()
            outs = self._engine.interrupt(list(traj_ids))
            masks = {tid: self._meta.pop(tid).mask for tid in outs if tid in self._meta}
            self._command_s["interrupt"] += self._clock() - started
        return {tid: _partial(o, masks.get(tid)) for tid, o in outs.items()}

    def abort(self, traj_ids: Iterable[int]) -> list[int]:
        with self._lock:
            started = self._clock()
            dropped = self._engine.abort(list(traj_ids))
            for tid in dropped:
                self._meta.pop(tid, None)
            self._command_s["abort"] += self._clock() - started
        return dropped

    # -- evaluation requests (rollout/eval_lane.py) --------------------------------------

    def submit_eval(self, requests: Sequence[EvalRequest]) -> None:
        """Queue evaluation requests; they enter the engine as the lane's cap allows."""
        with self._lock:
            self.check()
            self._eval.add(requests)
            admitted = self._eval.admit()
            if admitted:
                self._engine.submit(admitted)
                self._work.notify_all()

    def take_eval(self) -> list[EvalOutput]:
        """The evaluation responses finished since the last call."""
        with self._lock:
            self.check()
            return self._eval.take()

    # -- race copies (runtime/controller/races.py) -------------------------------------------------

    def submit_copy(
        self, routed: RoutedTrajectory, holder: InstanceId, draft_method: str | None = None
    ) -> None:
        """Start a race copy of a trajectory ``holder`` runs, from ``routed``'s prefix,
        drafting with ``draft_method`` (None: the engine's). It finishes through
        ``on_copy_finished`` with the holder's id, never as this instance's; a Pull here
        drops it (other weights would sample other tokens)."""
        if self._on_copy_finished is None:
            raise RuntimeError(f"instance {self.inst} was built without on_copy_finished")
        with self._lock:
            self.check()
            if routed.traj_id in self._meta:
                raise ValueError(f"instance {self.inst} already holds trajectory {routed.traj_id}")
            request = GenerationRequest(
                traj_id=routed.traj_id,
                prompt=routed.prompt,
                tokens=routed.tokens,
                logprobs=routed.logprobs,
                versions=routed.versions,
                max_response=self._max_response,
                group_id=routed.group_id,
                draft_method=draft_method,
            )
            self._engine.submit([request])
            r = routed
            self._meta[r.traj_id] = _meta(r)
            self._copies[r.traj_id] = holder
            self._work.notify_all()

    def rebase(self, traj_id: int) -> PartialTrajectory | None:
        """Resubmit a trajectory of this instance where it is now, and return its response
        so far (None: not here). For an engine that keys its draws by a request's resume
        point (vLLM), so that a race copy forked at that response samples the same tokens
        as the original from then on. Costs the original a prefill of its prefix."""
        with self._lock:
            if traj_id not in self._meta or traj_id in self._copies:
                return None
            out = self._engine.interrupt([traj_id]).get(traj_id)
            if out is None:
                return None
            m = self._meta[traj_id]
            self._engine.submit(
                [
                    GenerationRequest(
                        traj_id=traj_id,
                        prompt=m.prompt,
                        tokens=out.tokens,
                        logprobs=out.logprobs,
                        versions=out.versions,
                        max_response=chunk_cap(
                            len(out.tokens), self._max_response, self._chunk_tokens
                        ),
                        group_id=m.group_id,
                    )
                ]
            )
            self._work.notify_all()
        return _partial(out, m.mask)

    def copies(self) -> dict[int, InstanceId]:
        with self._lock:
            return dict(self._copies)

    def drop_copies(self, traj_ids: Iterable[int]) -> dict[int, CopyEnd]:
        """End the race copies of ``traj_ids`` here (their race is over): how each ended,
        stopped now if it was still running."""
        with self._lock:
            ids = list(traj_ids)
            out = self._drop_copies_locked(ids)
            out.update({t: self._copy_ends.pop(t) for t in ids if t in self._copy_ends})
            return out

    def _drop_copies_locked(self, traj_ids: Iterable[int]) -> dict[int, CopyEnd]:
        ids = [t for t in traj_ids if t in self._copies]
        if not ids:
            return {}
        outs = self._engine.interrupt(ids)
        for tid in ids:
            self._meta.pop(tid, None)
            del self._copies[tid]
        return {tid: CopyEnd(len(o.tokens), False) for tid, o in outs.items()}

    def settle_won(self, traj_ids: Iterable[int]) -> dict[int, int]:
        """A copy completed these trajectories of this instance: stop them here and count
        them as completed (Eq. 1 sees a completion, as if they had finished here);
        returns the response tokens each had."""
        with self._lock:
            ids = [t for t in traj_ids if t in self._meta and t not in self._copies]
            outs = self._engine.interrupt(ids)
            for tid in ids:
                self._meta.pop(tid, None)
                self._completed.append(tid)
        return {tid: len(o.tokens) for tid, o in outs.items()}

    def progress(self) -> dict[int, PartialTrajectory]:
        """The response so far of every trajectory here, without stopping it; empty for
        an engine that cannot tell (``staleflow.engines.base.ReportsProgress``)."""
        read = getattr(self._engine, "progress", None)
        if read is None:
            return {}
        with self._lock:
            outs = {
                tid: _partial(o, self._meta[tid].mask)
                for tid, o in read().items()
                if tid in self._meta and tid not in self._copies
            }
        return outs

    def between_steps(
        self, call: Callable[[RolloutEngine, dict[int, tuple[int, np.ndarray]]], T]
    ) -> T:
        """``call(engine, {trajectory here: (group, prompt)})`` between two engine steps, for
        calls into the engine that are no commands (handing it siblings' responses to draft
        from: staleflow/runtime/workers/sibling_drafts.py)."""
        with self._lock:
            return call(self._engine, {t: (m.group_id, m.prompt) for t, m in self._meta.items()})

    def load_weights(self, weights: Mapping[str, object], version: int) -> None:
        """Load pulled weights; the completed list restarts (the coordinator's Pull)."""
        self._pull(version, lambda: self._engine.load_weights(weights, version))

    def load_version(self, version: int) -> None:
        """Have a self-pulling engine (:class:`~staleflow.engines.base.SelfPullingEngine`)
        fetch ``version`` from the parameter server itself; otherwise as ``load_weights``."""
        self._pull(version, lambda: self._engine.load_version(version))  # type: ignore[attr-defined]

    def _pull(self, version: int, load: Callable[[], None]) -> None:
        with self._lock:
            started = self._clock()
            self.check()
            self._copy_ends.update(self._drop_copies_locked(list(self._copies)))
            if self._meta:
                # The coordinator interrupts an instance before it Pulls; whatever is still
                # here keeps generating with the new weights (versions are per token), which
                # the staleness bound allows since V_traj is fixed by the first token.
                logger.warning(
                    "instance %d loads version %d with %d trajectories still on it",
                    self.inst,
                    version,
                    len(self._meta),
                )
            load()
            self._completed.clear()
            elapsed = self._clock() - started
            self._load_s += elapsed
            self._command_s["pull"] += elapsed

    # -- views -------------------------------------------------------------------------

    def snapshot(self) -> InstanceSnapshot:
        # an engine that lists its kept prefixes (engines.base.KeepsPrefixes) tells the
        # coordinator what it holds; for the others the control plane assumes
        sizes = getattr(self._engine, "held_prefix_sizes", None)
        with self._lock:
            state = self._engine.state()
            return InstanceSnapshot(
                inst=self.inst,
                kv_cache=state.kv_tokens,
                run_trajs=tuple(self._record(t, n) for t, n in state.running if self._own(t)),
                wait_trajs=tuple(self._record(t, n) for t, n in state.waiting if self._own(t)),
                complete_trajs=tuple(self._completed),
                inst_version=state.version,
                held=() if sizes is None else tuple(h for h in sizes() if self._own(h[0])),
                held_exact=sizes is not None,
            )

    def times(self) -> InstanceTimes:
        with self._lock:
            t = self._engine.times()
            return InstanceTimes(
                busy_s=self._busy_s,
                idle_s=self._idle_s,
                prefill_s=t.prefill_s,
                decode_s=t.decode_s,
                prefill_tokens=t.prefill_tokens,
                decode_tokens=t.decode_tokens,
                load_s=self._load_s,
                finished=self._finished,
                command_s=dict(self._command_s),
                chunks=self._chunks,
                prefix_hits=t.prefix_hits,
                prefix_tokens=t.prefix_tokens,
                speculation=getattr(self._engine, "speculation_stats", lambda: None)(),
                speculation_by_method=getattr(
                    self._engine, "speculation_stats_by_method", lambda: None
                )(),
            )

    @property
    def version(self) -> int:
        with self._lock:
            return self._engine.state().version

    def add_command_time(self, kind: str, seconds: float) -> None:
        """Time a command kept this instance busy outside the engine (e.g. fetching the
        routed trajectories from the TS, or pulling weights from the PS)."""
        with self._lock:
            self._command_s[kind] += seconds

    def held(self) -> set[int]:
        """Trajectories running or waiting here (not the race copies)."""
        with self._lock:
            return set(self._meta) - set(self._copies)

    def held_prefixes(self) -> tuple[int, ...]:
        """Trajectories whose KV the engine keeps for their next turn (the embedded
        engine with ``prefix_cache_tokens``; empty for an engine without such a store),
        least recently kept first. A next turn routed here prefills only what is new; the
        store is emptied at every Pull."""
        read = getattr(self._engine, "held_prefixes", None)
        if read is None:
            return ()
        with self._lock:
            return tuple(read())

    def drop_prefixes(self, traj_ids: Iterable[int]) -> list[int]:
        """Forget the kept prefixes of ``traj_ids`` (their episodes ended or were
        aborted); returns those that were kept."""
        drop = getattr(self._engine, "drop_prefixes", None)
        if drop is None:
            return []
        with self._lock:
            return list(drop(list(traj_ids)))

    def _own(self, engine_id: int) -> bool:
        """A trajectory of this instance: not a race copy, not an evaluation request."""
        return engine_id not in self._copies and not self._eval.owns(engine_id)

    def _record(self, traj_id: int, length: int) -> TrajRecord:
        m = self._meta[traj_id]
        return TrajRecord(traj_id, m.group_id, m.v_traj, length, len(m.prompt))

    # -- the generation thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock.step():
                    idle_from = self._clock()
                    while not self._stop and not self._engine.has_work:
                        self._work.wait()
                    self._idle_s += self._clock() - idle_from
                    if self._stop:
                        return
                    started = self._clock()
                    outs = self._engine.step()
                    self._busy_s += self._clock() - started
                    if self._eval:  # evaluation requests end here, and the next go in
                        outs = self._finish_evals(outs)
                    copies: list[tuple[Finished, InstanceId]] = []
                    if self._copies:  # race copies finish in their holder's name
                        own = []
                        for o in outs:
                            if o.traj_id in self._copies:
                                holder = self._copies.pop(o.traj_id)
                                copies.append((self._finish(o, copy=True), holder))
                            else:
                                own.append(o)
                        outs = own
                    chunks = [self._chunk_end(o) for o in outs if self._at_chunk_end(o)]
                    finished = [self._finish(o) for o in outs if not self._at_chunk_end(o)]
                if copies:
                    assert self._on_copy_finished is not None  # submit_copy requires it
                    won = set(self._on_copy_finished(copies))
                    with self._lock:
                        for f, _ in copies:
                            t = f.task
                            self._copy_ends[t.traj_id] = CopyEnd(len(t.tokens), t.traj_id in won)
                if chunks:
                    assert self._on_chunk is not None  # chunk_tokens requires it
                    self._on_chunk(chunks)
                if finished:
                    self._on_finished(finished)
        except BaseException as exc:  # reported through check()
            logger.exception("rollout instance %d failed", self.inst)
            self._failure = exc

    def _finish_evals(self, outs: list[EngineOutput]) -> list[EngineOutput]:
        """Under the lock: keep the evaluation responses in ``outs`` in the lane, admit
        the next ones, and return the rest."""
        own = []
        for o in outs:
            if self._eval.owns(o.traj_id):
                self._eval.finish(o)
            else:
                own.append(o)
        admitted = self._eval.admit()
        if admitted:
            self._engine.submit(admitted)
        return own

    def _at_chunk_end(self, out: EngineOutput) -> bool:
        """Stopped for length before the real budget: the end of a chunk, not of a response."""
        return (
            self._chunk_tokens is not None
            and out.finish_reason == FINISH_LENGTH
            and len(out.tokens) < self._max_response
        )

    def _chunk_end(self, out: EngineOutput) -> PartialTrajectory:
        m = self._meta.pop(out.traj_id)
        self._completed.append(out.traj_id)  # it left: Eq. 1 counts it until the next Pull
        self._chunks += 1
        return _partial(out, m.mask)

    def _finish(self, out: EngineOutput, copy: bool = False) -> Finished:
        m = self._meta.pop(out.traj_id)
        if not copy:  # a copy's completion is its holder's (Eq. 1 counts it there)
            self._completed.append(out.traj_id)
            self._finished += 1
        task = RewardTask(
            traj_id=out.traj_id,
            group_id=m.group_id,
            v_traj=m.v_traj,
            sample_id=m.sample_id,
            answer=m.answer,
            prompt=m.prompt,
            tokens=out.tokens,
            logprobs=out.logprobs,
            versions=out.versions,
            finish_reason=out.finish_reason or "stop",
            mask=extend_mask(m.mask, len(out.tokens)),
        )
        return Finished(task, self.inst)


def _meta(r: RoutedTrajectory) -> _Meta:
    return _Meta(r.group_id, r.v_traj, r.sample_id, r.answer, r.prompt, r.mask)  # type: ignore[arg-type]  # set by __post_init__


def _partial(out: EngineOutput, mask: np.ndarray | None) -> PartialTrajectory:
    """The engine's response so far with its loss mask: the mask the trajectory came in
    with, then True for every token the engine added (``mask`` None: all True)."""
    full = None if mask is None else extend_mask(mask, len(out.tokens))
    return PartialTrajectory(out.traj_id, out.tokens, out.logprobs, out.versions, full)
