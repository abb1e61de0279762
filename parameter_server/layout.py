"""The unified sharding representation (paper App. A.1, step 2).

A :class:`Layout` is an ordered list of parameter specs packed into one
contiguous byte buffer at fixed offsets. Every party (trainer export, PS slot,
rollout destination) agrees on the same layout, so a version moves as one
flat ``memcpy``-able region and a :class:`Slice` is just a byte range with a
name, shape and dtype attached.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from parameter_server.errors import DestinationError, LayoutError, LayoutMismatchError

# Storage dtypes. bfloat16 has no numpy dtype without ml_dtypes, so its bits
# are stored as uint16; callers view a torch bf16 tensor as uint16 to hand it in.
_STORAGE: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "float64",
        "float32",
        "float16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
    )
}
_STORAGE["bfloat16"] = np.dtype("uint16")

SUPPORTED_DTYPES: tuple[str, ...] = tuple(sorted(_STORAGE))


def storage_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype that holds values of ``dtype`` (bfloat16 -> uint16 bits)."""
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise LayoutError(
            f"unsupported dtype {dtype!r}; use one of {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def dtype_name(dtype: np.dtype[Any] | str) -> str:
    """The layout dtype name of a numpy dtype (ml_dtypes' bfloat16 maps to 'bfloat16')."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    storage_dtype(name)
    return name


def dtype_accepts(spec_dtype: str, array_dtype: np.dtype[Any]) -> bool:
    """Whether an array of ``array_dtype`` may fill a parameter of ``spec_dtype``."""
    if array_dtype.name == spec_dtype:
        return True
    return spec_dtype == "bfloat16" and array_dtype == np.dtype("uint16")


@dataclass(frozen=True)
class ParamSpec:
    """One named parameter: its shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"parameter name must be a non-empty string, got {self.name!r}")
        shape = tuple(self.shape)
        if not all(isinstance(d, int | np.integer) and int(d) >= 0 for d in shape):
            raise LayoutError(
                f"parameter {self.name!r}: shape {self.shape!r} must be non-negative integers"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        storage_dtype(self.dtype)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return storage_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Slice:
    """A contiguous piece of one parameter: byte range ``[start, stop)`` of the layout buffer.

    ``shape`` is the shape of the piece itself (a row block of the parameter).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise LayoutError(f"slice of {self.name!r}: bad byte range [{self.start}, {self.stop})")
        expected = prod(self.shape) * storage_dtype(self.dtype).itemsize
        if expected != self.stop - self.start:
            raise LayoutError(
                f"slice of {self.name!r}: shape {self.shape} x {self.dtype} is {expected} bytes "
                f"but the byte range holds {self.stop - self.start}"
            )

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def _align(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


class Layout:
    """Ordered parameter specs at fixed, aligned offsets in one byte buffer."""

    def __init__(self, specs: Iterable[ParamSpec], alignment: int = 64) -> None:
        if alignment < 1 or alignment & (alignment - 1):
            raise LayoutError(f"alignment must be a power of two, got {alignment}")
        self._specs: tuple[ParamSpec, ...] = tuple(specs)
        self._alignment = alignment
        self._index: dict[str, int] = {}
        offsets: list[int] = []
        offset = 0
        for i, spec in enumerate(self._specs):
            if not isinstance(spec, ParamSpec):
                raise LayoutError(f"layout entries must be ParamSpec, got {type(spec).__name__}")
            if spec.name in self._index:
                raise LayoutError(f"parameter {spec.name!r} appears twice; names must be unique")
            self._index[spec.name] = i
            offset = _align(offset, max(alignment, spec.itemsize))
            offsets.append(offset)
            offset += spec.nbytes
        self._offsets = tuple(offsets)
        self._nbytes = _align(offset, alignment) if self._specs else 0

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], alignment: int = 64) -> Layout:
        """The layout of a name -> array mapping, in the mapping's order."""
        return cls(
            (ParamSpec(n, tuple(a.shape), dtype_name(a.dtype)) for n, a in arrays.items()),
            alignment,
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        """Inverse of :meth:`to_dict` (the form sent over the wire)."""
        try:
            specs = [ParamSpec(str(n), tuple(s), str(d)) for n, s, d in data["params"]]
            return cls(specs, int(data["alignment"]))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, LayoutError):
                raise
            raise LayoutError(f"not a serialised layout: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {
            "alignment": self._alignment,
            "params": [[s.name, list(s.shape), s.dtype] for s in self._specs],
        }

    # -- queries ------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Size of the packed buffer, padding included."""
        return self._nbytes

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._specs)

    @property
    def specs(self) -> tuple[ParamSpec, ...]:
        return self._specs

    @property
    def fingerprint(self) -> str:
        """Stable digest that two processes compare to agree on a layout."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"Layout({len(self)} params, {self._nbytes} bytes, {self.fingerprint})"

    def spec(self, name: str) -> ParamSpec:
        return self._specs[self._position(name)]

    def offset(self, name: str) -> int:
        return self._offsets[self._position(name)]

    def slice(self, name: str) -> Slice:
        """The whole of parameter ``name`` as a slice."""
        spec = self.spec(name)
        start = self.offset(name)
        return Slice(name, spec.shape, spec.dtype, start, start + spec.nbytes)

    def slices(self) -> list[Slice]:
        return [self.slice(n) for n in self.names]

    def row_slices(self, name: str, parts: int) -> list[Slice]:
        """Split parameter ``name`` into ``parts`` equal row blocks along dimension 0."""
        spec = self.spec(name)
        if not spec.shape or parts < 1 or spec.shape[0] % parts:
            raise LayoutError(
                f"cannot split {name!r} of shape {spec.shape} into {parts} equal row blocks; "
                "pick a part count that divides the first dimension"
            )
        rows = spec.shape[0] // parts
        row_bytes = prod(spec.shape[1:]) * spec.itemsize
        base = self.offset(name)
        return [
            Slice(
                name,
                (rows, *spec.shape[1:]),
                spec.dtype,
                base + i * rows * row_bytes,
                base + (i + 1) * rows * row_bytes,
            )
            for i in range(parts)
        ]

    def byte_ranges(self, slices: Iterable[Slice]) -> list[tuple[int, int]]:
        """The ``[start, stop)`` of each slice, after checking it lies inside its parameter."""
        ranges = []
        for s in slices:
            whole = self.slice(s.name)
            if not (whole.start <= s.start <= s.stop <= whole.stop) or s.dtype != whole.dtype:
                raise LayoutMismatchError(
                    f"slice of {s.name!r} at bytes [{s.start}, {s.stop}) is not inside that "
                    f"parameter ([{whole.start}, {whole.stop}), {whole.dtype}) in this layout; "
                    "build slices from the same layout"
                )
            ranges.append((s.start, s.stop))
        return ranges

    def _position(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise LayoutMismatchError(
                f"parameter {name!r} is not in the layout; known names start with "
                f"{list(self.names[:5])}"
            ) from None

    # -- buffers ------------------------------------------------------------------

    def check_buffer(
        self,
        buffer: np.ndarray,
        what: str = "buffer",
        error: type[Exception] = DestinationError,
    ) -> np.ndarray:
        """Return ``buffer`` as a flat uint8 view after checking it can hold the layout."""
        if not isinstance(buffer, np.ndarray):
            raise error(f"{what} must be a numpy array, got {type(buffer).__name__}")
        if not buffer.flags.c_contiguous:
            raise error(f"{what} must be C-contiguous; pass np.ascontiguousarray(...)")
        if buffer.nbytes != self._nbytes:
            raise error(
                f"{what} holds {buffer.nbytes} bytes but the layout needs {self._nbytes}; "
                f"allocate it with np.empty({self._nbytes}, dtype=np.uint8)"
            )
        return buffer.reshape(-1).view(np.uint8)

    def views(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        """Name -> array views into a packed buffer (no copy)."""
        flat = self.check_buffer(buffer)
        out: dict[str, np.ndarray] = {}
        for spec, offset in zip(self._specs, self._offsets, strict=True):
            raw = flat[offset : offset + spec.nbytes]
            out[spec.name] = raw.view(storage_dtype(spec.dtype)).reshape(spec.shape)
        return out

    def validate(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Raise :class:`LayoutMismatchError` unless ``arrays`` matches the layout exactly."""
        missing = [n for n in self.names if n not in arrays]
        extra = [n for n in arrays if n not in self._index]
        if missing or extra:
            raise LayoutMismatchError(
                f"parameter set differs from the registered layout: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                f"{' ...' if len(extra) > 5 else ''}; export exactly the registered names "
                "or register a new layout"
            )
        for spec in self._specs:
            arr = arrays[spec.name]
            if not isinstance(arr, np.ndarray):
                raise LayoutMismatchError(
                    f"{spec.name!r} is a {type(arr).__name__}; pass numpy arrays "
                    "(tensor.numpy() or parameter_server.torch_compat.to_numpy)"
                )
            if tuple(arr.shape) != spec.shape:
                raise LayoutMismatchError(
                    f"{spec.name!r} has shape {tuple(arr.shape)}, the layout says {spec.shape}"
                )
            if not dtype_accepts(spec.dtype, arr.dtype):
                raise LayoutMismatchError(
                    f"{spec.name!r} has dtype {arr.dtype.name}, the layout says {spec.dtype}; "
                    f"cast it with .astype({storage_dtype(spec.dtype).name!r}) first"
                )

    def pack(self, arrays: Mapping[str, np.ndarray], out: np.ndarray) -> None:
        """Copy ``arrays`` into the packed buffer ``out`` (validated first)."""
        self.validate(arrays)
        views = self.views(out)
        for name, view in views.items():
            np.copyto(view, arrays[name].view(view.dtype), casting="no")


def common_granularity(layout: Layout, slicings: Sequence[Sequence[Slice]]) -> list[Slice]:
    """The coarsest slicing that refines every slicing in ``slicings`` (App. A.2).

    Senders and receivers may cut a parameter differently (e.g. TP 4 vs TP 2);
    cutting at the union of their boundaries gives pieces that each lie wholly
    inside one sender's and one receiver's slice. Cuts must fall on row
    boundaries.
    """
    cuts: dict[str, set[int]] = {}
    for slicing in slicings:
        for s in slicing:
            whole = layout.slice(s.name)
            if s.start < whole.start or s.stop > whole.stop:
                raise LayoutError(f"slice {s} lies outside parameter {s.name!r}")
            cuts.setdefault(s.name, {whole.start, whole.stop}).update((s.start, s.stop))
    out: list[Slice] = []
    for name in layout.names:
        if name not in cuts:
            continue
        spec = layout.spec(name)
        row_bytes = prod(spec.shape[1:]) * spec.itemsize if spec.shape else spec.nbytes
        base = layout.offset(name)
        points = sorted(cuts[name])
        for lo, hi in itertools.pairwise(points):
            if (lo - base) % max(row_bytes, 1) or (hi - base) % max(row_bytes, 1):
                raise LayoutError(f"cut of {name!r} at bytes {lo}..{hi} is not on a row boundary")
            rows = (hi - lo) // row_bytes if row_bytes else 0
            shape = (rows, *spec.shape[1:]) if spec.shape else ()
            out.append(Slice(name, shape, spec.dtype, lo, hi))
    return out
