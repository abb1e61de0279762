"""An :class:`~staleflow.runtime.interface.InstanceHandle` over a local rollout instance:
the instance fetches routed trajectories from the TS, returns interrupted ones to it,
and pulls weights from the PS itself, so payloads never pass through the control plane.

A partial whose trajectory redundancy (§4.3) aborted in the TS meanwhile is a late
message: dropped, while the trajectory still counts as stopped here.

Recovery (``docs/recovery.md``): every incarnation of an instance has its own ``holder``
id in the TS and names it in what it sends, so that the messages of one declared lost are
refused there; a Route the TS refuses for that reason means this incarnation must stop
(:class:`~staleflow.runtime.interface.InstanceGone`). With ``progress_every_s`` the host
reports the responses generated so far to the TS on a thread of its own, so that losing
the instance costs only the tokens generated since the last report; an engine with
grouped drafts (``rollout.speculation.method: group``) is handed, on the same thread, the
responses of its trajectories' siblings that ran elsewhere (``sibling_drafts.py``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from coordinator.types import InstanceSnapshot
from staleflow.control.late import return_live
from staleflow.engines.base import RolloutEngine
from staleflow.rollout.eval_lane import EvalOutput, EvalRequest
from staleflow.rollout.instance import CopyEnd, Finished, InstanceTimes, RolloutInstance
from staleflow.runtime.interface import InstanceGone
from staleflow.runtime.workers.sibling_drafts import SiblingDrafts, SiblingServer
from staleflow.runtime.workers.weight_transfer import PullSource
from trajectory_server.errors import NotHolder
from trajectory_server.types import (
    InstanceId,
    PartialTrajectory,
    RoutedTrajectory,
)

logger = logging.getLogger(__name__)


class RoutingServer(SiblingServer, Protocol):
    """The part of the TS an instance uses (siblings' responses included)."""

    def route(
        self,
        traj_ids: Sequence[int],
        v_traj: Mapping[int, int],
        instance_id: InstanceId,
        *,
        skip_unavailable: bool = False,
    ) -> tuple[RoutedTrajectory, ...]: ...

    def interrupt_return(
        self, partials: Sequence[PartialTrajectory], *, instance_id: InstanceId | None = None
    ) -> None: ...

    def report_progress(
        self, partials: Sequence[PartialTrajectory], instance_id: InstanceId
    ) -> tuple[int, ...]: ...

    def fork(self, traj_id: int, instance_id: InstanceId) -> RoutedTrajectory | None: ...


class InstanceHost:
    def __init__(
        self,
        inst: int,
        engine: RolloutEngine,
        *,
        ts: RoutingServer,
        weights: PullSource,
        max_response: int,
        on_finished: Callable[[list[Finished]], None],
        holder: InstanceId | None = None,
        chunk_tokens: int | None = None,
        on_copy_finished: Callable[[list[tuple[Finished, InstanceId]]], Collection[int]]
        | None = None,
        eval_running: int = 16,
    ) -> None:
        self.inst = inst
        self.holder: InstanceId = inst if holder is None else holder
        self._engine = engine
        self._ts = ts
        self._weights = weights
        self.instance = RolloutInstance(
            inst,
            engine,
            max_response=max_response,
            on_finished=on_finished,
            chunk_tokens=chunk_tokens,
            on_chunk=self._chunk_ends if chunk_tokens is not None else None,
            on_copy_finished=on_copy_finished,
            eval_running=eval_running,
        )
        self._reported: dict[int, int] = {}  # trajectory -> tokens the TS has from us
        # an engine that speculates may run a request drafting from its group (its own
        # method, or a race copy's, rollout.speculation.race_method) even where its own
        # method is not: the fetch runs while one does (fetch_siblings)
        speculates = getattr(engine, "speculation_stats", lambda: None)() is not None
        self.siblings = (
            SiblingDrafts(self.instance, ts, self.holder)
            if hasattr(engine, "drafts_from_siblings") and speculates
            else None
        )
        self._progress_stop = threading.Event()
        self._progress_thread: threading.Thread | None = None
        self.progress_reports = 0

    def _chunk_ends(self, partials: list[PartialTrajectory]) -> None:
        """Divided rollout: a chunk ended; the trajectory waits in the TS to be re-placed
        (with its V_traj and Reserve, as after an Interrupt). It names this incarnation,
        so a chunk of one declared lost is refused (docs/recovery.md)."""
        return_live(self._ts, partials, instance_id=self.holder)

    def start(self, at_least: int = 0, progress_every_s: float = 0.0) -> int:
        """Load the first weights and start generating; returns their version. With
        ``progress_every_s`` > 0, report progress to the TS that often. An engine with LoRA
        adapters (``trainer.lora``) loads the frozen base first, once: every later Pull
        moves the adapter alone."""
        if getattr(self._engine, "adapters", False):
            started = time.perf_counter()
            self._engine.load_base_weights(self._weights.fetch_base())  # type: ignore[attr-defined]
            self.instance.add_command_time("pull", time.perf_counter() - started)
        version = self.pull(at_least)
        self.instance.start()
        if progress_every_s > 0:
            self._progress_thread = threading.Thread(
                target=self._report_loop,
                args=(progress_every_s,),
                name=f"progress-{self.inst}",
                daemon=True,
            )
            self._progress_thread.start()
        return version

    def stop(self) -> None:
        self._progress_stop.set()
        self.instance.stop()

    def _check(self) -> None:
        try:
            self.instance.check()
        except RuntimeError as exc:
            raise InstanceGone(self.inst, str(exc)) from exc

    # -- InstanceHandle ----------------------------------------------------------------

    def snapshot(self) -> InstanceSnapshot:
        self._check()
        return self.instance.snapshot()

    def route(self, traj_ids: Sequence[int], v_traj: Mapping[int, int]) -> tuple[int, ...]:
        self._check()
        started = time.perf_counter()
        try:
            routed = self._ts.route(
                list(traj_ids), dict(v_traj), self.holder, skip_unavailable=True
            )
        except NotHolder as exc:  # the control plane declared this incarnation lost
            raise InstanceGone(self.inst, str(exc)) from exc
        self.instance.add_command_time("route", time.perf_counter() - started)
        try:
            self.instance.submit(routed)
        except BaseException:
            # Never strand trajectories the TS believes are here.
            return_live(
                self._ts,
                [
                    PartialTrajectory(r.traj_id, r.tokens, r.logprobs, r.versions, r.mask)
                    for r in routed
                ],
                instance_id=self.holder,
            )
            raise
        return tuple(r.traj_id for r in routed)

    def interrupt(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        partials = self.instance.interrupt(traj_ids)
        if partials:
            started = time.perf_counter()
            return_live(self._ts, list(partials.values()), instance_id=self.holder)
            self.instance.add_command_time("interrupt", time.perf_counter() - started)
        # every trajectory stopped here, also one the TS had dropped: it left this instance
        return tuple(partials)

    def abort(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.instance.abort(traj_ids))

    # -- evaluation (rollout/eval_lane.py): no trajectories, never in the TS -------------

    def submit_eval(self, requests: Sequence[EvalRequest]) -> int:
        """Queue evaluation requests on this instance; returns how many."""
        self._check()
        self.instance.submit_eval(requests)
        return len(requests)

    def take_eval(self) -> list[EvalOutput]:
        """The evaluation responses finished since the last call."""
        self._check()
        return self.instance.take_eval()

    # -- race copies (runtime/races.py) -------------------------------------------------

    def race(self, traj_id: int, holder: InstanceId, draft_method: str | None = None) -> int | None:
        """Start a copy of ``traj_id``, which ``holder`` runs, from the response the TS has
        of it, drafting with ``draft_method`` (None: the engine's); returns that response's
        length, None if the TS no longer has it routed there (the race is off)."""
        self._check()
        fork = self._ts.fork(traj_id, holder)
        if fork is None:
            return None
        self.instance.submit_copy(fork, holder, draft_method)
        return len(fork.tokens)

    def prepare_race(self, traj_id: int) -> bool:
        """On the holder, before a copy of ``traj_id`` forks: with an engine that keys its
        draws by the resume point (none of the built-in engines now; vLLM did before its
        draws were keyed by position), resubmit the original where it is and report that
        response to the TS, which the copy then forks; False if it is not here."""
        if not getattr(self._engine, "samples_by_resume_point", False):
            return traj_id in self.instance.held()
        partial = self.instance.rebase(traj_id)
        if partial is None:
            return False
        self._ts.report_progress([partial], self.holder)
        return True

    def drop_copies(self, traj_ids: Sequence[int]) -> dict[int, CopyEnd]:
        return self.instance.drop_copies(traj_ids)

    def settle_won(self, traj_ids: Sequence[int]) -> dict[int, int]:
        return self.instance.settle_won(traj_ids)

    def copies(self) -> dict[int, InstanceId]:
        return self.instance.copies()

    def pull(self, at_least: int) -> int:
        if getattr(self._engine, "pulls_from_parameter_server", False):
            # The engine's own workers fetch the weights (SGLang's TP ranks): only the
            # version number passes through here.
            version = self._weights.latest_version(at_least)  # type: ignore[attr-defined]
            self.instance.load_version(version)
            return version
        started = time.perf_counter()
        version, weights = self._weights.fetch(at_least)
        self.instance.add_command_time("pull", time.perf_counter() - started)
        self.instance.load_weights(weights, version)
        return version

    def times(self) -> InstanceTimes:
        return self.instance.times()

    def held(self) -> set[int]:
        return self.instance.held()

    def held_prefixes(self) -> tuple[int, ...]:
        """Trajectories between turns whose KV this instance still holds (none after a
        Pull): routing a trajectory's next turn here saves prefilling its prefix. For the
        coordinator's routing preference (docs/agentic.md, "KV reuse across turns")."""
        return self.instance.held_prefixes()

    def drop_prefixes(self, traj_ids: Sequence[int]) -> list[int]:
        """Free the KV kept for ``traj_ids``' next turns (their episodes ended)."""
        return self.instance.drop_prefixes(traj_ids)

    # -- progress ------------------------------------------------------------------------

    def report_progress(self) -> int:
        """Send the TS the responses that grew since the last report; returns how many
        it recorded (those it no longer routes here are ignored there)."""
        grown = [
            p
            for tid, p in self.instance.progress().items()
            if len(p.tokens) > self._reported.get(tid, 0)
        ]
        if not grown:
            return 0
        recorded = set(self._ts.report_progress(grown, self.holder))
        held = self.instance.held()
        self._reported = {
            tid: n for tid, n in self._reported.items() if tid in held
        }  # forget the trajectories that left
        for p in grown:
            if p.traj_id in recorded:
                self._reported[p.traj_id] = len(p.tokens)
        self.progress_reports += 1
        return len(recorded)

    def fetch_siblings(self) -> int:
        """Grouped drafts: hand the engine the new tokens of its groups' members elsewhere
        and have it forget the groups gone from the TS; the tokens handed (0: off)."""
        if self.siblings is None or not getattr(self._engine, "drafts_from_siblings", False):
            return 0
        return self.siblings.fetch()

    def _report_loop(self, every_s: float) -> None:
        while not self._progress_stop.wait(every_s):
            # both are optimisations: never stop generating for them
            try:
                self.report_progress()
            except Exception as exc:
                logger.warning("instance %d: progress report failed: %s", self.inst, exc)
            try:
                self.fetch_siblings()  # after the report: the TS has ours for the others
            except Exception as exc:
                logger.warning("instance %d: fetching siblings failed: %s", self.inst, exc)
