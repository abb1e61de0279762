"""An :class:`~staleflow.runtime.interface.InstanceHandle` over a local rollout instance:
the instance fetches routed trajectories from the TS, returns interrupted ones to it,
and pulls weights from the PS itself, so payloads never pass through the control plane.

A partial whose trajectory redundancy (§4.3) aborted in the TS meanwhile is a late
message: dropped, while the trajectory still counts as stopped here."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from coordinator.types import InstanceSnapshot
from staleflow.control.late import return_live
from staleflow.engines.base import RolloutEngine
from staleflow.rollout.instance import Finished, InstanceTimes, RolloutInstance
from staleflow.runtime.weights import PullSource
from trajectory_server.types import InstanceId, PartialTrajectory, RoutedTrajectory

logger = logging.getLogger(__name__)


class RoutingServer(Protocol):
    """The part of the TS an instance uses."""

    def route(
        self,
        traj_ids: Sequence[int],
        v_traj: Mapping[int, int],
        instance_id: InstanceId,
        *,
        skip_unavailable: bool = False,
    ) -> tuple[RoutedTrajectory, ...]: ...

    def interrupt_return(self, partials: Sequence[PartialTrajectory]) -> None: ...


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
        chunk_tokens: int | None = None,
    ) -> None:
        self.inst = inst
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
        )

    def _chunk_ends(self, partials: list[PartialTrajectory]) -> None:
        """Divided rollout: a chunk ended; the trajectory waits in the TS to be re-placed
        (with its V_traj and Reserve, as after an Interrupt)."""
        return_live(self._ts, partials)

    def start(self, at_least: int = 0) -> int:
        """Load the first weights and start generating; returns their version."""
        version = self.pull(at_least)
        self.instance.start()
        return version

    def stop(self) -> None:
        self.instance.stop()

    # -- InstanceHandle ----------------------------------------------------------------

    def snapshot(self) -> InstanceSnapshot:
        self.instance.check()
        return self.instance.snapshot()

    def route(self, traj_ids: Sequence[int], v_traj: Mapping[int, int]) -> tuple[int, ...]:
        self.instance.check()
        started = time.perf_counter()
        routed = self._ts.route(list(traj_ids), dict(v_traj), self.inst, skip_unavailable=True)
        self.instance.add_command_time("route", time.perf_counter() - started)
        try:
            self.instance.submit(routed)
        except BaseException:
            # Never strand trajectories the TS believes are here.
            return_live(
                self._ts,
                [PartialTrajectory(r.traj_id, r.tokens, r.logprobs, r.versions) for r in routed],
            )
            raise
        return tuple(r.traj_id for r in routed)

    def interrupt(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        partials = self.instance.interrupt(traj_ids)
        if partials:
            started = time.perf_counter()
            return_live(self._ts, list(partials.values()))
            self.instance.add_command_time("interrupt", time.perf_counter() - started)
        # every trajectory stopped here, also one the TS had dropped: it left this instance
        return tuple(partials)

    def abort(self, traj_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.instance.abort(traj_ids))

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
