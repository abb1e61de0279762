"""The sender side of a sharded Push: which pieces each trainer rank sends to which PS
replica, and sending them.

Every rank of a tensor-parallel group holds one shard of each parameter of its pipeline
stage (the stage's layers under their global numbers: the rank renames Megatron's
stage-local ones); data-parallel replicas hold the same shards. The staging layout of
:meth:`~parameter_server.convert_megatron.MegatronToHF.staging_layout` names each TP rank's
shard ``tp{r}/<megatron name>``. Every PS replica (App. A.1: one per rollout node) needs
the whole staging layout. :func:`plan_shard_push` cuts every staged parameter into row
blocks (one per data-parallel replica, where the rows divide) and gives each block, for
each PS replica, to one of the ranks that hold it with the load-balancing plan of App. A.2
(:func:`~parameter_server.plan.build_plan`): with ``dp`` data-parallel replicas each rank
sends about ``1 / dp`` of its shard to each PS replica. Every rank computes the same plan
from the same inputs, so no rank has to tell another what to send; and every rank sends
one message to every PS replica per version (an empty one where the plan gives it
nothing there), because a replica publishes a version once all declared senders arrived.

The bytes travel over each replica's control socket (a Unix socket on its node, TCP
across nodes: the PS workers of a multi-node run listen on TCP); every (rank, replica)
link is taken as equal, so the plan balances bytes.

A replica can be lost (its process died) and restarted empty at a new endpoint. A
:class:`ShardPushGroup` then stops sending to the lost one and goes on with the others;
once the replica is back, every rank reconnects to it (:meth:`~ShardPushGroup.reconnect`)
and sends it its pieces of the current version (:meth:`~ShardPushGroup.push_to`): a
fresh replica takes any version first, so it publishes that version once every rank's
pieces arrived.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from parameter_server import wire
from parameter_server.assemble import declaration
from parameter_server.convert_megatron import MegatronToHF, pipeline_stage
from parameter_server.errors import LayoutMismatchError, TransportError
from parameter_server.layout import Layout, Slice
from parameter_server.plan import Link, build_plan
from parameter_server.replicas import ReplicaRoute
from parameter_server.torch_compat import to_numpy
from parameter_server.transport.base import ControlClient, Endpoint

logger = logging.getLogger(__name__)

# what a sender sees of a replica whose process died
LOST = (TransportError, OSError)

# Every rank's link to the PS is taken as equal: the plan then balances bytes.
_DEFAULT_LINK = Link(bandwidth=1e9, latency=1e-4)
RECEIVER = "ps"


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_start, row_stop)`` of the rank's local parameter ``name``, which land at
    ``staged`` in the staging buffer."""

    name: str
    row_start: int
    row_stop: int
    staged: Slice


def plan_shard_push(
    converter: MegatronToHF,
    tp_ranks: Sequence[int],
    replicas: Sequence[str] = (RECEIVER,),
    stages: Sequence[int] | None = None,
) -> dict[int, dict[str, list[Piece]]]:
    """Sender (global rank) -> PS replica -> its pieces for that replica. ``tp_ranks[g]`` and
    ``stages[g]`` are global rank ``g``'s TP rank and pipeline stage (all 0 without
    pipeline parallelism); ranks of the same TP rank and stage are data-parallel replicas."""
    staging = converter.staging_layout()
    stages = list(stages) if stages is not None else [0] * len(tp_ranks)
    if len(stages) != len(tp_ranks):
        raise ValueError(f"{len(stages)} pipeline stages for {len(tp_ranks)} ranks")
    pp = max(stages) + 1
    places = list(zip(tp_ranks, stages, strict=True))
    copies = max(places.count(p) for p in set(places))
    needs: list[Slice] = []
    for spec in staging:
        rows = spec.shape[0] if spec.shape else 1
        parts = copies if spec.shape and rows % copies == 0 else 1
        needs.extend(
            staging.row_slices(spec.name, parts) if parts > 1 else [staging.slice(spec.name)]
        )
    layers = converter.config.num_layers
    holdings = {
        f"rank{g}": [
            s
            for s in (staging.slice(spec.name) for spec in staging)
            if _tp_of(s) == t and pipeline_stage(_name_of(s), layers, pp) == stage
        ]
        for g, (t, stage) in enumerate(places)
    }
    plan = build_plan(dict.fromkeys(replicas, needs), holdings, {}, _DEFAULT_LINK)
    out: dict[int, dict[str, list[Piece]]] = {
        g: {replica: [] for replica in replicas} for g in range(len(tp_ranks))
    }
    for transfer in plan.transfers:
        g = int(transfer.sender.removeprefix("rank"))
        out[g][transfer.receiver].append(_piece(staging, transfer.slice))
    return out


def _tp_of(s: Slice) -> int:
    return int(s.name.split("/", 1)[0].removeprefix("tp"))


def _name_of(s: Slice) -> str:
    return s.name.split("/", 1)[1]


def _piece(staging: Layout, s: Slice) -> Piece:
    spec = staging.spec(s.name)
    row_bytes = prod(spec.shape[1:]) * spec.itemsize if spec.shape else spec.nbytes
    first = (s.start - staging.offset(s.name)) // row_bytes
    rows = s.shape[0] if s.shape else 1
    return Piece(s.name.split("/", 1)[1], first, first + rows, s)


class ShardPushClient:
    """One rank's connection to one PS worker for sharded Pushes.

    ``push(tensors, version)`` sends this rank's pieces of ``tensors`` (its local parameters
    by Megatron name: numpy arrays, or torch tensors copied to host piece by piece) and
    returns the version once the PS published it (this rank was the last sender), else
    None. It has the ``push(weights, version)`` shape of
    :class:`parameter_server.push.BackgroundPusher`'s target, so Pushes run in the
    background, overlapped with the next step.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        converter: MegatronToHF,
        *,
        rank: int,
        tp_ranks: Sequence[int],
        pieces: Sequence[Piece] | None = None,
    ) -> None:
        self.rank = rank
        # a PS of its own: the single-replica plan; one of several: the group's plan
        self._pieces = (
            list(pieces)
            if pieces is not None
            else plan_shard_push(converter, tp_ranks)[rank][RECEIVER]
        )
        self._staging = converter.staging_layout()
        self._control = ControlClient(endpoint, f"shards-{rank}-{os.getpid()}")
        self._control.request(
            wire.DeclareShards(declaration(converter.config, converter.tp_size, len(tp_ranks)))
        )

    @property
    def pieces(self) -> list[Piece]:
        return list(self._pieces)

    @property
    def nbytes(self) -> int:
        """Bytes this rank sends per Push."""
        return sum(p.staged.nbytes for p in self._pieces)

    def push(self, weights: Mapping[str, Any], version: int | None = None) -> int | None:
        if version is None:
            raise ValueError("a sharded Push names its version: every rank must send the same")
        payload = [self._bytes(weights, p) for p in self._pieces]
        ranges = tuple((p.staged.start, p.staged.stop) for p in self._pieces)
        message = wire.PushShard(version, self.rank, ranges, sum(a.nbytes for a in payload))
        control = self._control
        with control.lock:
            try:
                wire.send(control.sock, message)
                for array in payload:
                    control.sock.sendall(memoryview(array).cast("B"))
                reply = wire.recv(control.sock)
            except OSError as exc:
                raise TransportError(f"sharded Push of version {version} broke: {exc}") from exc
        if isinstance(reply, wire.Failure):
            wire.raise_failure(reply)
        return reply.version if isinstance(reply, wire.Published) else None

    def _bytes(self, weights: Mapping[str, Any], piece: Piece) -> np.ndarray:
        try:
            source = weights[piece.name]
        except KeyError:
            raise LayoutMismatchError(
                f"rank {self.rank} has no parameter {piece.name!r} to push"
            ) from None
        rows = source[piece.row_start : piece.row_stop] if piece.staged.shape else source
        if not isinstance(rows, np.ndarray):
            rows = to_numpy(rows)
        array = np.ascontiguousarray(rows)
        if (
            array.nbytes != piece.staged.nbytes
            or array.dtype.itemsize != self._staging.spec(piece.staged.name).itemsize
        ):
            raise LayoutMismatchError(
                f"rank {self.rank}: {piece.name} rows {piece.row_start}:{piece.row_stop} are "
                f"{array.shape} {array.dtype}, the plan expects {piece.staged.shape} "
                f"{piece.staged.dtype}"
            )
        return array

    def close(self) -> None:
        self._control.close()


class ShardPushGroup:
    """One rank's sharded Pushes to every PS replica: a :class:`ShardPushClient` per
    replica with the pieces :func:`plan_shard_push` gives this rank there, sending to all
    replicas concurrently. ``routes[g]`` are rank ``g``'s routes to the replicas, in the same
    replica order for every rank (each rank computes the plan from all of them).

    ``push`` has the :class:`~parameter_server.push.BackgroundPusher` target shape; it
    returns the version when this rank's message published it on every replica, else None.
    """

    def __init__(
        self,
        converter: MegatronToHF,
        *,
        rank: int,
        tp_ranks: Sequence[int],
        routes: Mapping[int, Sequence[ReplicaRoute]],
        stages: Sequence[int] | None = None,
    ) -> None:
        replicas = [r.replica for r in routes[rank]]
        odd = [g for g, rs in routes.items() if [r.replica for r in rs] != replicas]
        if odd or len(routes) != len(tp_ranks):
            raise ValueError(
                f"every one of the {len(tp_ranks)} ranks needs routes to the same replicas "
                f"{replicas} (ranks {odd} differ); build them from one PS pool"
            )
        self.rank = rank
        self._converter, self._tp_ranks = converter, list(tp_ranks)
        self._plan = plan_shard_push(converter, tp_ranks, replicas, stages)[rank]
        self._endpoints = {r.replica: r.endpoint for r in routes[rank]}
        self._clients: dict[str, ShardPushClient] = {}
        self._lost: set[str] = set()
        # a Push and a reconnect never interleave (the background pusher's thread and a
        # refill's)
        self._lock = threading.Lock()
        try:
            for route in routes[rank]:
                self._clients[route.replica] = self._connect(route.replica, route.endpoint)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(len(self._clients), thread_name_prefix="shard-push")

    def _connect(self, replica: str, endpoint: Endpoint) -> ShardPushClient:
        return ShardPushClient(
            endpoint,
            self._converter,
            rank=self.rank,
            tp_ranks=self._tp_ranks,
            pieces=self._plan[replica],
        )

    @property
    def replicas(self) -> list[str]:
        return list(self._clients)

    @property
    def lost(self) -> set[str]:
        """Replicas this rank stopped sending to (until :meth:`reconnect`)."""
        return set(self._lost)

    def sent_bytes(self) -> dict[str, int]:
        """Bytes this rank sends each replica per version."""
        return {replica: c.nbytes for replica, c in self._clients.items()}

    @property
    def nbytes(self) -> int:
        return sum(self.sent_bytes().values())

    def push(self, weights: Mapping[str, Any], version: int | None = None) -> int | None:
        """Send this rank's pieces to every replica not lost; a replica lost now is left
        out (logged) until :meth:`reconnect`. Returns ``version`` once it is published on
        every replica this rank sent to, else None."""
        with self._lock:
            return self._push(
                {n: c for n, c in self._clients.items() if n not in self._lost}, weights, version
            )

    def push_to(
        self, replicas: Sequence[str], weights: Mapping[str, Any], version: int
    ) -> int | None:
        """Send this rank's pieces of ``version`` to ``replicas`` only (a refill)."""
        with self._lock:
            return self._push({n: self._clients[n] for n in replicas}, weights, version)

    def _push(
        self,
        clients: Mapping[str, ShardPushClient],
        weights: Mapping[str, Any],
        version: int | None,
    ) -> int | None:
        futures = {n: self._pool.submit(c.push, weights, version) for n, c in clients.items()}
        published = []
        for name, future in futures.items():
            try:
                published.append(future.result())
            except LOST as exc:
                self._lost.add(name)
                logger.warning(
                    "rank %d: PS replica %s was lost (%s); Pushing to the others until it is back",
                    self.rank,
                    name,
                    exc,
                )
        return version if published and all(p == version for p in published) else None

    def reconnect(self, endpoints: Mapping[str, Endpoint]) -> list[str]:
        """Connect anew to every replica that was lost or now serves at another endpoint
        (it was restarted); returns their names. Those hold none of this rank's pieces:
        :meth:`push_to` them the current version."""
        with self._lock:
            moved = [
                n
                for n, e in endpoints.items()
                if n in self._clients and (n in self._lost or e != self._endpoints[n])
            ]
            for name in moved:
                try:
                    self._clients[name].close()
                except OSError:
                    logger.debug("closing the lost replica %s failed", name, exc_info=True)
                self._lost.add(name)  # until the new connection stands
                self._clients[name] = self._connect(name, endpoints[name])
                self._endpoints[name] = endpoints[name]
                self._lost.discard(name)
            return moved

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for c in self._clients.values():
            try:
                c.close()
            except OSError:
                logger.debug("closing a PS connection failed", exc_info=True)
