"""Load-balancing communication plan: cases whose right answer is known by hand."""

from __future__ import annotations

import pytest

from parameter_server.layout import Layout, ParamSpec, Slice
from parameter_server.plan import Link, PlanError, Planner, build_plan

GB = 1e9


@pytest.fixture
def layout() -> Layout:
    # four 1 GB parameters (250M float32 each); byte ranges only, nothing allocated
    return Layout([ParamSpec(f"p{i}", (250_000_000,), "float32") for i in range(4)])


def test_equal_links_alternate_between_senders(layout: Layout) -> None:
    holdings = {"ps0": layout.slices(), "ps1": layout.slices()}
    plan = build_plan({"r0": layout.slices()}, holdings, {}, Link(GB, 0.001))
    assert [t.sender for t in plan.transfers] == ["ps0", "ps1", "ps0", "ps1"]
    assert plan.load("ps0") == pytest.approx(2.002) == plan.load("ps1")
    assert plan.makespan_s == pytest.approx(2.002)


def test_a_fast_local_sender_takes_what_it_can_finish_sooner(layout: Layout) -> None:
    holdings = {"remote": layout.slices(), "local": layout.slices()}
    links = {("local", "r0"): Link(10 * GB), ("remote", "r0"): Link(1 * GB, 0.01)}
    plan = build_plan({"r0": layout.slices()}, holdings, links)
    # local: 0.1 s per slice, so it takes all four (0.4 s) before remote's 1.01 s pays off
    assert [t.sender for t in plan.transfers] == ["local"] * 4
    assert plan.load("local") == pytest.approx(0.4) and plan.load("remote") == 0.0


def test_only_holders_are_candidates_and_load_accumulates(layout: Layout) -> None:
    s = layout.slices()
    holdings = {"a": [s[0], s[1], s[2]], "b": [s[2], s[3]]}
    plan = build_plan({"r": s}, holdings, {}, Link(GB))
    # p0, p1 only on a; p2: a has 2 s queued, b has 0 -> b; p3 only on b
    assert [(t.slice.name, t.sender) for t in plan.transfers] == [
        ("p0", "a"),
        ("p1", "a"),
        ("p2", "b"),
        ("p3", "b"),
    ]
    assert plan.load("a") == pytest.approx(2.0) and plan.load("b") == pytest.approx(2.0)


def test_receivers_share_the_senders_load(layout: Layout) -> None:
    s = layout.slices()
    holdings = {"a": s, "b": s}
    plan = build_plan({"r0": s[:2], "r1": s[:2]}, holdings, {}, Link(GB))
    assert [(t.receiver, t.sender) for t in plan.transfers] == [
        ("r0", "a"),
        ("r0", "b"),
        ("r1", "a"),
        ("r1", "b"),
    ]
    assert len(plan.for_receiver("r1")) == 2 and len(plan.for_sender("a")) == 2


def test_needed_slice_is_cut_at_holder_boundaries() -> None:
    layout = Layout([ParamSpec("w", (4, 2), "float32")])
    halves = layout.row_slices("w", 2)  # TP-2 senders, each holds half the rows
    plan = build_plan(
        {"r": [layout.slice("w")]}, {"t0": [halves[0]], "t1": [halves[1]]}, {}, Link(1.0)
    )
    assert [(t.sender, t.slice.start, t.slice.stop, t.slice.shape) for t in plan.transfers] == [
        ("t0", 0, 16, (2, 2)),
        ("t1", 16, 32, (2, 2)),
    ]


def test_missing_holder_or_link_is_an_error(layout: Layout) -> None:
    s = layout.slices()
    with pytest.raises(PlanError, match="no sender holds"):
        build_plan({"r": [s[3]]}, {"a": s[:3]}, {}, Link(GB))
    with pytest.raises(PlanError, match="no link from 'a' to 'r'"):
        build_plan({"r": [s[0]]}, {"a": s}, {})
    with pytest.raises(PlanError, match="bandwidth"):
        Link(0)
    need = Slice("p0", (2, 2), "float32", 0, 16)
    mid_row = {"a": [Slice("p0", (1,), "float32", 0, 4)], "b": [need]}
    with pytest.raises(PlanError, match="inside a row"):
        build_plan({"r": [need]}, mid_row, {}, Link(GB))


def test_planner_computes_once_and_reuses(layout: Layout) -> None:
    planner = Planner({}, Link(GB))
    s = layout.slices()
    first = planner.plan({"r": s}, {"a": s, "b": s})
    again = planner.plan({"r": list(s)}, {"a": list(s), "b": list(s)})
    assert again is first and planner.cached == 1
    planner.plan({"r": s[:1]}, {"a": s})
    assert planner.cached == 2
