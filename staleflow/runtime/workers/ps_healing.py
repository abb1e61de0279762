"""Parameter-server clients that survive a restarted replica (``docs/recovery.md``).

A PS replica holds no durable state: when its actor dies, the supervisor starts a new
one under the same Ray name (``<run>/ps/<k>``) and the trainer refills it with its
latest weights. Its endpoint is new, so every client reconnects: a client that loses its
replica asks the resolver for the endpoint the replica's actor now serves, reconnects,
and retries, for up to ``patience_s``:

- :class:`HealingPull` (a rollout instance's Pull) also waits until the new replica holds
  a version at least the one it was asked for;
- :class:`HealingPush` (the trainer's Push) pushes to a replica that came back empty or
  behind on its own, then to all of them again together;
- :class:`HealingVersions` (the control plane's PS version) keeps the last version it
  knew while a replica is away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from parameter_server import Layout
from parameter_server.errors import (
    BaseWeightsError,
    PushVersionError,
    TransportError,
    VersionNotHeldError,
)
from parameter_server.replicas import ReplicaGroup, ReplicaRoute, connect_replica, replica_group
from parameter_server.store import Weights
from parameter_server.transport.base import ControlClient, Endpoint
from staleflow.runtime.placement.ray_cluster import actor_name

logger = logging.getLogger(__name__)

# what a client sees of a replica that went away (or came back empty)
LOST = (TransportError, OSError, VersionNotHeldError)
Resolve = Callable[[str], Endpoint]  # replica role -> the endpoint its actor serves now


class ReplicaResolver:
    """Finds the endpoint a replica's actor serves now, by its Ray name. Picklable: each
    actor gets one and asks Ray from its own process."""

    def __init__(self, run: str, namespace: str) -> None:
        self.run, self.namespace = run, namespace

    def __call__(self, replica: str) -> Endpoint:
        import ray

        actor = ray.get_actor(actor_name(self.run, replica), namespace=self.namespace)
        return ray.get(actor.endpoint.remote(), timeout=30)


def _retry(what: str, patience_s: float, attempt: Callable[[], Any]) -> Any:
    """``attempt()`` until it returns, for up to ``patience_s`` (it raises LOST meanwhile;
    a replica being restarted also makes the resolver fail, with any Ray error)."""
    deadline = time.monotonic() + patience_s
    delay = 0.05
    while True:
        try:
            return attempt()
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"{what}: the parameter server did not come back within {patience_s:g} s "
                    f"({exc}); raise recovery.ps_patience_s if restarts are slow"
                ) from exc
            logger.info("%s: waiting for the parameter server (%s)", what, exc)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


class HealingPull:
    """A :class:`~staleflow.runtime.workers.weight_transfer.PullSource` over one replica (the one on the
    instance's node)."""

    def __init__(
        self, route: ReplicaRoute, layout: Layout, resolve: Resolve, patience_s: float
    ) -> None:
        self._route, self._layout = route, layout
        self._resolve, self._patience = resolve, patience_s
        self._transport: Any = connect_replica(route)
        self._buffer = np.empty(layout.nbytes, dtype=np.uint8)
        self.reconnects = 0

    @property
    def name(self) -> str:
        return str(self._transport.name)

    def fetch(self, at_least: int) -> tuple[int, Mapping[str, np.ndarray]]:
        def attempt() -> int:
            if self._transport is None:
                self._reconnect()
            try:
                version = self._transport.pull(self._buffer)
            except LOST:
                self._drop()
                raise
            if version < at_least:  # a restarted replica the trainer has not refilled yet
                raise VersionNotHeldError(at_least, (version,), f"the PS holds {version} so far")
            return version

        version = _retry(f"Pull of version >= {at_least}", self._patience, attempt)
        return version, self._layout.views(self._buffer)

    def fetch_base(self) -> Mapping[str, np.ndarray]:
        """The frozen base of adapter versions (``trainer.lora``), once per instance: views
        of a buffer of its own, dropped once the engine has copied them. Waits, as
        ``fetch`` does, for a restarted replica to be given it again."""
        base = self._layout_of_base()
        buffer = np.empty(base.nbytes, dtype=np.uint8)

        def attempt() -> None:
            if self._transport is None:
                self._reconnect()
            try:
                self._transport.pull_base(buffer)
            except LOST:
                self._drop()
                raise

        _retry("Pull of the base weights", self._patience, attempt)
        return base.views(buffer)

    def _layout_of_base(self) -> Layout:
        if self._transport is None:
            _retry("reconnecting to the PS", self._patience, self._reconnect)
        base = self._transport.base_layout
        if base is None:
            raise BaseWeightsError(
                f"PS replica {self._route.replica} holds full-weight versions: an instance "
                "with LoRA adapters needs the run's PS started with the base layout"
            )
        return base

    def latest_version(self, at_least: int) -> int:
        """The newest version the replica holds, for engines whose own workers pull it
        (SGLang's TP ranks: ``InstanceHost.pull``), with the same patience as ``fetch``."""

        def attempt() -> int:
            if self._transport is None:
                self._reconnect()
            try:
                latest = self._transport.info().latest
            except LOST:
                self._drop()
                raise
            version = -1 if latest is None else int(latest)
            if version < at_least:
                raise VersionNotHeldError(at_least, (version,), f"the PS holds {version} so far")
            return version

        return _retry(f"the latest version >= {at_least}", self._patience, attempt)

    def _reconnect(self) -> None:
        route = replace(self._route, endpoint=self._resolve(self._route.replica))
        self._transport = connect_replica(route)
        self._route = route
        self.reconnects += 1

    def _drop(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            try:
                transport.close()
            except Exception:  # its worker is gone: nothing to close cleanly
                logger.debug("closing a lost PS transport failed", exc_info=True)

    def close(self) -> None:
        self._drop()


class HealingPush:
    """The trainer's Push target over every replica (a ``PushTarget``). One Push at a
    time: the background pusher's and a refill never interleave."""

    def __init__(
        self,
        routes: Sequence[ReplicaRoute],
        receiver: str,
        resolve: Resolve,
        patience_s: float,
    ) -> None:
        self._routes = {r.replica: r for r in routes}
        self._receiver, self._resolve, self._patience = receiver, resolve, patience_s
        self._lock = threading.Lock()
        self._group: ReplicaGroup | None = replica_group(list(routes), receiver)
        self.heals = 0

    @property
    def group(self) -> ReplicaGroup:
        if self._group is None:
            self._group = self._reconnect()
        return self._group

    def transports(self) -> dict[str, str]:
        return self.group.transports()

    def pull(self, dest: np.ndarray, version: int | None = None) -> int:
        return _retry(
            "the trainer's first Pull", self._patience, lambda: self.group.pull(dest, version)
        )

    @property
    def base_layout(self) -> Layout | None:
        return self.group.base_layout

    def pull_base(self, dest: np.ndarray) -> None:
        """The base of adapter versions (the trainer's first Pull, with ``pull``)."""
        _retry("the trainer's Pull of the base", self._patience, lambda: self.group.pull_base(dest))

    def push(self, weights: Weights, version: int | None = None) -> int:
        with self._lock:
            try:
                return self.group.push(weights, version)
            except (*LOST, PushVersionError) as exc:  # a replica died or came back behind
                # a replica died, or came back empty and was refilled meanwhile
                logger.info("Push of version %s replica by replica: %s", version, exc)
            _retry(
                f"Push of version {version}", self._patience, lambda: self._fill(weights, version)
            )
            return self.group.common_version()

    def refill(self, weights: Weights, version: int, base: Weights | None = None) -> int:
        """Give replicas that came back empty or behind ``version`` (the trainer's newest
        weights; with ``base``, the base of adapter versions first, where it is missing);
        returns how many were refilled."""

        def fill() -> int:
            if base is not None:
                self._group = self._reconnect() if self._group is None else self._group
                try:
                    self._group.push_base(base)
                except LOST:
                    self._close_group()
                    raise
            return self._fill(weights, version)

        with self._lock:
            return _retry(f"refill of version {version}", self._patience, fill)

    def _fill(self, weights: Weights, version: int | None) -> int:
        """Push to every replica not yet at ``version``, one by one (a fresh replica takes
        any version first; the others take their next)."""
        self._group = self._reconnect() if self._group is None else self._group
        filled = 0
        try:
            for name in self._group.names:
                transport = self._group.replica(name)
                latest = transport.info().latest
                if version is not None and latest is not None and latest >= version:
                    continue
                transport.push(weights, version)
                filled += 1
                logger.info("PS replica %s refilled with version %s", name, version)
        except LOST:
            self._close_group()
            raise
        return filled

    def _reconnect(self) -> ReplicaGroup:
        routes = [replace(r, endpoint=self._resolve(name)) for name, r in self._routes.items()]
        group = replica_group(routes, self._receiver)
        self._routes = {r.replica: r for r in routes}
        self.heals += 1
        return group

    def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            try:
                group.close()
            except Exception:
                logger.debug("closing a lost PS replica group failed", exc_info=True)

    def close(self) -> None:
        with self._lock:
            self._close_group()


class HealingVersions:
    """The newest version every replica holds (the control plane's PS version); while a
    replica is away, the last version known, so the coordinator's plans stay sane."""

    def __init__(self, endpoints: Mapping[str, Endpoint], resolve: Resolve) -> None:
        self._endpoints = dict(endpoints)
        self._resolve = resolve
        self._clients: dict[str, ControlClient] = {}
        self._last = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ps-versions")
        self._refreshing = threading.Event()

    def latest(self) -> int:
        try:
            versions = []
            for name in self._endpoints:
                client = self._clients.get(name)
                if client is None:
                    client = self._clients[name] = ControlClient(self._endpoints[name], "control")
                versions.append(client.info().latest)
        except LOST as exc:
            logger.info("PS version unknown while a replica is away: %s", exc)
            self._forget()
            if not self._refreshing.is_set():  # find the new endpoints off the loop thread
                self._refreshing.set()
                self._pool.submit(self._refresh)
            return self._last
        if any(v is None for v in versions):
            return self._last  # a replica came back empty: it is being refilled
        self._last = max(self._last, min(v for v in versions if v is not None))
        return self._last

    def _refresh(self) -> None:
        try:
            self._endpoints = {name: self._resolve(name) for name in self._endpoints}
        except Exception as exc:  # not back yet: the next miss asks again
            logger.debug("PS endpoints not resolved yet: %s", exc)
        finally:
            self._refreshing.clear()

    def _forget(self) -> None:
        clients, self._clients = self._clients, {}
        for c in clients.values():
            try:
                c.close()
            except Exception:
                logger.debug("closing a lost PS control client failed", exc_info=True)

    def close(self) -> None:
        self._forget()
        self._pool.shutdown(wait=False)
