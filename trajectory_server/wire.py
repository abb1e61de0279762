"""Typed wire messages of the trajectory server, packed with msgpack.

A message is ``[tag, [field, ...]]``: the tag picks the dataclass, fields follow its
declaration order, nested dataclasses are field lists too (their type comes from the
annotation). NumPy arrays travel as a msgpack extension holding dtype, shape and the raw
little-endian bytes — never as lists of Python ints. Decoded arrays are read-only views
of the received buffer (no copy).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from trajectory_server.errors import WireError
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    GroupStatus,
    NextTurn,
    PartialTrajectory,
    RewardTask,
    RoutableTrajectory,
    RoutedTrajectory,
    SiblingResponses,
    SiblingTokens,
    TrainingBatch,
    TrainingGroup,
    TrainingTrajectory,
    TrajState,
)

T = TypeVar("T")

_ARRAY_EXT = 1
_ALLOWED = tuple(
    np.dtype(name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64",
    )
)  # fmt: skip
# wire name (little-endian dtype string) -> dtype; lookups here keep the per-array cost low
_BY_NAME = {d.newbyteorder("<").str.encode(): d.newbyteorder("<") for d in _ALLOWED}
_NAME_OF = {d.newbyteorder("<"): name for name, d in _BY_NAME.items()}
_SHAPE = [struct.Struct(f"<{ndim}Q") for ndim in range(33)]


# ------------------------------------------------------------------ arrays


def _encode_array(arr: np.ndarray) -> msgpack.ExtType:
    dtype = arr.dtype
    name = _NAME_OF.get(dtype)
    if name is None:  # big-endian, or not allowed at all
        dtype = dtype.newbyteorder("<")
        name = _NAME_OF.get(dtype)
        if name is None:
            raise WireError(f"arrays of dtype {arr.dtype} cannot travel; use a numeric dtype")
        arr = arr.astype(dtype)
    if arr.ndim >= len(_SHAPE):
        raise WireError(f"arrays of {arr.ndim} dimensions cannot travel")
    header = bytes((len(name),)) + name + bytes((arr.ndim,)) + _SHAPE[arr.ndim].pack(*arr.shape)
    return msgpack.ExtType(_ARRAY_EXT, header + arr.tobytes())  # tobytes: C order


def _decode_array(data: bytes) -> np.ndarray:
    try:
        name_len = data[0]
        name = data[1 : 1 + name_len]
        ndim = data[1 + name_len]
        offset = 2 + name_len
        shape = _SHAPE[ndim].unpack_from(data, offset)
    except (IndexError, struct.error) as exc:
        raise WireError(f"corrupt array header: {exc}") from None
    dtype = _BY_NAME.get(name)
    if dtype is None:
        raise WireError(f"array dtype {name!r} is not allowed on the wire")
    offset += 8 * ndim
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise WireError(
            f"array of shape {shape} and dtype {dtype} needs {count * dtype.itemsize} bytes, "
            f"got {len(data) - offset}"
        )
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def _default(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        return _encode_array(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"cannot pack {type(obj).__name__}; wire messages carry typed dataclasses")


def _ext_hook(code: int, data: bytes) -> object:
    if code == _ARRAY_EXT:
        return _decode_array(data)
    raise WireError(f"unknown msgpack extension {code}")


# ---------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class RouteRequest:
    traj_ids: tuple[int, ...]
    v_traj: int | None  # one version for all, or None
    v_traj_by_traj: dict[int, int]  # per-trajectory versions (used when v_traj is None)
    instance_id: int | str
    skip_unavailable: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class RouteReply:
    trajectories: tuple[RoutedTrajectory, ...]


@dataclass(frozen=True, slots=True, eq=False)
class InterruptReturn:
    partials: tuple[PartialTrajectory, ...]
    instance_id: int | str | None = None  # set: refuse trajectories not held by it


@dataclass(frozen=True, slots=True, eq=False)
class CompletionBatch:
    completions: tuple[Completion, ...]
    instance_id: int | str | None = None
    worker_id: int | str | None = None  # set: refuse trajectories not scored by it


@dataclass(frozen=True, slots=True, eq=False)
class ProgressReport:
    partials: tuple[PartialTrajectory, ...]
    instance_id: int | str


@dataclass(frozen=True, slots=True, eq=False)
class HandToReward:
    finished: tuple[FinishedTrajectory, ...]
    worker_id: int | str
    instance_id: int | str | None = None


@dataclass(frozen=True, slots=True, eq=False)
class NextTurnBatch:
    turns: tuple[NextTurn, ...]
    worker_id: int | str


@dataclass(frozen=True, slots=True)
class SiblingRequest:
    """``group_responses``: per group, the tokens the caller has of each member."""

    known: dict[int, dict[int, int]]
    instance_id: int | str | None = None
    watch: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class RewardTaskBatch:
    tasks: tuple[RewardTask, ...]


@dataclass(frozen=True, slots=True)
class GroupStatusBatch:
    statuses: tuple[GroupStatus, ...]


@dataclass(frozen=True, slots=True, eq=False)
class RoutingColumns:
    """The routing view as columns: one small message instead of thousands of records."""

    traj_ids: np.ndarray  # int64
    group_ids: np.ndarray  # int64
    v_traj: np.ndarray  # int64; -1 where the trajectory is initial
    lengths: np.ndarray  # int64
    prompt_lens: np.ndarray  # int64

    @classmethod
    def from_records(cls, records: Sequence[RoutableTrajectory]) -> RoutingColumns:
        if not records:
            empty = np.empty(0, dtype=np.int64)
            return cls(empty, empty, empty, empty, empty)
        traj_ids, group_ids, v_traj, lengths, prompt_lens = zip(*records, strict=True)
        return cls(
            traj_ids=np.array(traj_ids, dtype=np.int64),
            group_ids=np.array(group_ids, dtype=np.int64),
            v_traj=np.array([-1 if v is None else v for v in v_traj], dtype=np.int64),
            lengths=np.array(lengths, dtype=np.int64),
            prompt_lens=np.array(prompt_lens, dtype=np.int64),
        )

    def to_records(self) -> tuple[RoutableTrajectory, ...]:
        v_traj = [None if v < 0 else v for v in self.v_traj.tolist()]
        columns = (self.traj_ids, self.group_ids, v_traj, self.lengths, self.prompt_lens)
        rows = zip(*(c if isinstance(c, list) else c.tolist() for c in columns), strict=True)
        return tuple(map(RoutableTrajectory._make, rows))


# ------------------------------------------------------------------- codec


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    encode: Callable[[Any], Any] | None  # None: msgpack packs the value as it is
    decode: Callable[[Any], Any] | None  # None: the msgpack value is used as it is


class _Codec:
    """Per-class field plans, built once from the type annotations."""

    def __init__(self) -> None:
        self._plans: dict[type, tuple[_Field, ...]] = {}
        self._by_tag: dict[str, type] = {}
        self._tag_of: dict[type, str] = {}

    def register(self, cls: type, tag: str) -> None:
        self._by_tag[tag] = cls
        self._tag_of[cls] = tag
        self._plan(cls)

    def _plan(self, cls: type) -> tuple[_Field, ...]:
        plan = self._plans.get(cls)
        if plan is None:
            hints = typing.get_type_hints(cls)
            plan = tuple(
                _Field(f.name, self._encoder(hints[f.name]), self._decoder(hints[f.name]))
                for f in dataclasses.fields(cls)
            )
            self._plans[cls] = plan
        return plan

    def _encoder(self, hint: Any) -> Callable[[Any], Any] | None:
        origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            return self._fields
        if origin is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            return lambda value: [self._fields(v) for v in value]
        if origin is Mapping:
            return dict  # a read-only mapping packs as a plain map
        return None

    def _decoder(self, hint: Any) -> Callable[[Any], Any] | None:
        origin = typing.get_origin(hint)
        if dataclasses.is_dataclass(hint):
            cls = typing.cast(type, hint)
            self._plan(cls)
            return lambda value: self._build(cls, value)
        if isinstance(hint, type) and issubclass(hint, TrajState):
            return TrajState
        if origin is tuple:
            inner = self._decoder(typing.get_args(hint)[0])
            if inner is None:
                return tuple
            return lambda value: tuple(inner(v) for v in value)
        if origin in (typing.Union, types.UnionType):
            # only ``X | None`` of scalars and enums is used in the messages
            decoders = [self._decoder(a) for a in typing.get_args(hint) if a is not type(None)]
            inner = decoders[0] if len(decoders) == 1 else None
            if inner is None:
                return None
            return lambda value: None if value is None else inner(value)
        return None

    def _fields(self, obj: object) -> list[Any]:
        plan = self._plans.get(type(obj))
        if plan is None:
            raise WireError(f"a {type(obj).__name__} cannot stand where a record is expected")
        out = []
        for f in plan:
            value = getattr(obj, f.name)
            out.append(value if f.encode is None else f.encode(value))
        return out

    def _build(self, cls: type, values: Any) -> Any:
        plan = self._plans[cls]
        if not isinstance(values, list) or len(values) != len(plan):
            raise WireError(f"{cls.__name__} needs {len(plan)} fields, got {values!r:.80}")
        kwargs = {}
        for f, value in zip(plan, values, strict=True):
            kwargs[f.name] = value if f.decode is None or value is None else f.decode(value)
        return cls(**kwargs)

    def pack(self, msg: object) -> bytes:
        tag = self._tag_of.get(type(msg))
        if tag is None:
            raise WireError(f"{type(msg).__name__} is not a wire message")
        return msgpack.packb([tag, self._fields(msg)], default=_default, use_bin_type=True)

    def unpack(self, data: bytes, expect: type[T] | None = None) -> T:
        try:
            tag, fields = msgpack.unpackb(
                data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True
            )
        except WireError:
            raise
        except Exception as exc:
            raise WireError(f"not a wire message: {exc}") from None
        cls = self._by_tag.get(tag)
        if cls is None:
            raise WireError(
                f"unknown message tag {tag!r}; sender and receiver run different StaleFlow versions"
            )
        if expect is not None and cls is not expect:
            raise WireError(f"expected a {expect.__name__}, got a {cls.__name__}")
        try:
            return self._build(cls, fields)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, WireError):
                raise
            raise WireError(f"malformed {cls.__name__}: {exc}") from None


_CODEC = _Codec()
MESSAGES: dict[str, type] = {
    "route_request": RouteRequest,
    "route_reply": RouteReply,
    "interrupt_return": InterruptReturn,
    "completion_batch": CompletionBatch,
    "group_status_batch": GroupStatusBatch,
    "training_batch": TrainingBatch,
    "routing_columns": RoutingColumns,
    "progress_report": ProgressReport,
    "hand_to_reward": HandToReward,
    "reward_task_batch": RewardTaskBatch,
    "next_turn_batch": NextTurnBatch,
    "aborted_trajectory": AbortedTrajectory,
    "training_group": TrainingGroup,
    "training_trajectory": TrainingTrajectory,
    "sibling_request": SiblingRequest,
    "sibling_responses": SiblingResponses,
    "sibling_tokens": SiblingTokens,
}
for _tag, _cls in MESSAGES.items():
    _CODEC.register(_cls, _tag)


def pack(msg: object) -> bytes:
    """Encode a registered message (see ``MESSAGES``)."""
    return _CODEC.pack(msg)


def unpack(data: bytes, expect: type[T] | None = None) -> T:
    """Decode a message, dispatching on its tag; ``expect`` checks its type."""
    return _CODEC.unpack(data, expect)


def pack_plain(tree: object) -> bytes:
    """Encode plain data (dicts, lists, str, int, float, bool, None) with numpy arrays as
    raw bytes, e.g. a saved state. Anything else is refused: no pickled objects."""
    try:
        return msgpack.packb(tree, default=_default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot pack this state: {exc}") from None


def unpack_plain(data: bytes) -> Any:
    """Decode what :func:`pack_plain` wrote; arrays come back read-only."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"not a packed state: {exc}") from None
