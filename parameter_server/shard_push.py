"""The sender side of a sharded Push: which pieces each trainer rank sends, and sending them.

Every rank of a tensor-parallel group holds one shard of each parameter; data-parallel
replicas hold the same shards. The staging layout of
:meth:`~parameter_server.convert_megatron.MegatronToHF.staging_layout` names each TP rank's
shard ``tp{r}/<megatron name>``. :func:`plan_shard_push` cuts every staged parameter into
row blocks (one per replica, where the rows divide) and gives each block to one of the
ranks that hold it with the load-balancing plan of App. A.2 (:func:`~parameter_server.plan.build_plan`):
with ``dp`` replicas each sends about ``1 / dp`` of its shard. Every rank computes the same
plan from the same inputs, so no rank has to tell another what to send.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from parameter_server import wire
from parameter_server.assemble import declaration
from parameter_server.convert_megatron import MegatronToHF
from parameter_server.errors import LayoutMismatchError, TransportError
from parameter_server.layout import Layout, Slice
from parameter_server.plan import Link, build_plan
from parameter_server.transport.base import ControlClient, Endpoint

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


def plan_shard_push(converter: MegatronToHF, tp_ranks: Sequence[int]) -> dict[int, list[Piece]]:
    """Sender (global rank) -> its pieces. ``tp_ranks[g]`` is global rank ``g``'s TP rank;
    ranks of the same TP rank are replicas (data parallelism)."""
    staging = converter.staging_layout()
    replicas = max(sum(1 for r in tp_ranks if r == t) for t in range(converter.tp_size))
    needs: list[Slice] = []
    for spec in staging:
        rows = spec.shape[0] if spec.shape else 1
        parts = replicas if spec.shape and rows % replicas == 0 else 1
        needs.extend(
            staging.row_slices(spec.name, parts) if parts > 1 else [staging.slice(spec.name)]
        )
    holdings = {
        f"rank{g}": [s for s in (staging.slice(spec.name) for spec in staging) if _tp_of(s) == t]
        for g, t in enumerate(tp_ranks)
    }
    plan = build_plan({RECEIVER: needs}, holdings, {}, _DEFAULT_LINK)
    out: dict[int, list[Piece]] = {g: [] for g in range(len(tp_ranks))}
    for transfer in plan.transfers:
        g = int(transfer.sender.removeprefix("rank"))
        out[g].append(_piece(staging, transfer.slice))
    return out


def _tp_of(s: Slice) -> int:
    return int(s.name.split("/", 1)[0].removeprefix("tp"))


def _piece(staging: Layout, s: Slice) -> Piece:
    spec = staging.spec(s.name)
    row_bytes = prod(spec.shape[1:]) * spec.itemsize if spec.shape else spec.nbytes
    first = (s.start - staging.offset(s.name)) // row_bytes
    rows = s.shape[0] if s.shape else 1
    return Piece(s.name.split("/", 1)[1], first, first + rows, s)


class ShardPushClient:
    """One rank's connection to a PS worker for sharded Pushes.

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
    ) -> None:
        self.rank = rank
        self._pieces = plan_shard_push(converter, tp_ranks)[rank]
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
            from parameter_server.torch_compat import to_numpy

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
