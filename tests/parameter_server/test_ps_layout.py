from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest

from parameter_server.errors import DestinationError, LayoutError, LayoutMismatchError
from parameter_server.layout import Layout, ParamSpec, Slice, common_granularity

WeightsFactory = Callable[[float], dict[str, np.ndarray]]


def test_offsets_are_fixed_aligned_and_disjoint(layout: Layout) -> None:
    ranges = sorted((layout.offset(s.name), layout.offset(s.name) + s.nbytes) for s in layout)
    for (_, stop), (start, _) in itertools.pairwise(ranges):
        assert stop <= start
    assert all(layout.offset(n) % 64 == 0 for n in layout.names)
    assert layout.nbytes % 64 == 0 and layout.nbytes >= ranges[-1][1]
    assert Layout(layout.specs).to_dict() == layout.to_dict()  # deterministic


def test_pack_then_views_round_trip(layout: Layout, make_weights: WeightsFactory) -> None:
    rng = np.random.default_rng(0)
    weights = {k: (rng.random(v.shape) * 100).astype(v.dtype) for k, v in make_weights(0).items()}
    buf = np.zeros(layout.nbytes, np.uint8)
    layout.pack(weights, buf)
    views = layout.views(buf)
    assert list(views) == list(layout.names)
    for name, arr in weights.items():
        assert views[name].dtype == arr.dtype
        np.testing.assert_array_equal(views[name], arr)
    assert np.shares_memory(views["embed"], buf)


def test_dict_round_trip_and_fingerprint(layout: Layout) -> None:
    again = Layout.from_dict(layout.to_dict())
    assert again == layout and again.fingerprint == layout.fingerprint
    other = Layout([*layout.specs[:-1], ParamSpec("steps", (4,), "int64")])
    assert other.fingerprint != layout.fingerprint


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([ParamSpec("a", (2,), "float32"), ParamSpec("a", (3,), "float32")], "twice"),
        ([("a", (2,), "float32")], "ParamSpec"),
    ],
)
def test_bad_layouts_are_rejected(specs: list, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        Layout(specs)


def test_bad_specs_are_rejected() -> None:
    with pytest.raises(LayoutError, match="unsupported dtype"):
        ParamSpec("a", (2,), "complex64")
    with pytest.raises(LayoutError, match="non-negative"):
        ParamSpec("a", (-1,), "float32")
    with pytest.raises(LayoutError, match="non-empty"):
        ParamSpec("", (1,), "float32")
    with pytest.raises(LayoutError, match="power of two"):
        Layout([], alignment=3)


def test_validate_names_the_problem(layout: Layout, make_weights: WeightsFactory) -> None:
    w = make_weights(0)
    del w["embed"]
    w["extra"] = np.zeros(1)
    with pytest.raises(LayoutMismatchError, match=r"missing \['embed'\].*unexpected \['extra'\]"):
        layout.validate(w)
    w = make_weights(0)
    w["embed"] = np.zeros((17, 9), np.float32)
    with pytest.raises(LayoutMismatchError, match=r"shape \(17, 9\)"):
        layout.validate(w)
    w = make_weights(0)
    w["embed"] = w["embed"].astype(np.float64)
    with pytest.raises(LayoutMismatchError, match=r"float64.*astype"):
        layout.validate(w)


def test_bfloat16_accepts_uint16_bits_only(layout: Layout, make_weights: WeightsFactory) -> None:
    w = make_weights(0)
    layout.validate(w)
    w["bf16"] = w["bf16"].astype(np.float16)
    with pytest.raises(LayoutMismatchError, match="bfloat16"):
        layout.validate(w)


def test_buffer_checks(layout: Layout) -> None:
    with pytest.raises(DestinationError, match="allocate"):
        layout.views(np.zeros(layout.nbytes - 1, np.uint8))
    with pytest.raises(DestinationError, match="contiguous"):
        layout.views(np.zeros(2 * layout.nbytes, np.uint8)[::2])


def test_slices_and_row_split() -> None:
    layout = Layout([ParamSpec("w", (4, 3), "float32"), ParamSpec("b", (3,), "float32")])
    whole = layout.slice("w")
    assert (whole.start, whole.stop, whole.shape) == (0, 48, (4, 3))
    parts = layout.row_slices("w", 2)
    assert [(p.start, p.stop, p.shape) for p in parts] == [(0, 24, (2, 3)), (24, 48, (2, 3))]
    with pytest.raises(LayoutError, match="divides"):
        layout.row_slices("w", 3)
    with pytest.raises(LayoutError, match="holds"):
        Slice("w", (2, 3), "float32", 0, 20)


def test_common_granularity_refines_both_sides() -> None:
    layout = Layout([ParamSpec("w", (4, 3), "float32"), ParamSpec("b", (3,), "float32")])
    senders = layout.row_slices("w", 2)  # TP 2
    receivers = [layout.row_slices("w", 4)[0], Slice("w", (3, 3), "float32", 12, 48)]
    pieces = common_granularity(layout, [senders, receivers])
    assert [(p.start, p.stop) for p in pieces] == [(0, 12), (12, 24), (24, 48)]
    assert [p.shape for p in pieces] == [(1, 3), (1, 3), (2, 3)]
    with pytest.raises(LayoutError, match="row boundary"):
        common_granularity(layout, [[Slice("w", (1,), "float32", 0, 4)]])
