"""Admission and repacking arithmetic against independent oracles."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from staleness.feasibility import AdmissionCounts
from tests.staleness.oracle import brute_lexmax_occupied, flow_feasible


@st.composite
def states(draw, max_groups: int = 7):
    """A feasible state: reserved groups by version, occupied groups by committed buffer."""
    eta = draw(st.integers(0, 3))
    batch = draw(st.integers(1, 3))
    capacity = batch + draw(st.integers(0, 2))
    version = draw(st.integers(eta, eta + 3))
    counts = AdmissionCounts(eta, batch, capacity, version)
    groups = []
    for _ in range(draw(st.integers(0, max_groups))):
        v = draw(st.integers(version - eta, version))
        if draw(st.booleans()):
            b = draw(st.integers(version, v + eta))
            trial = [*groups, (version, b, True)]
            if counts.pinned_by_buffer()[b - version] < batch and flow_feasible(
                trial, version, eta + 1, batch, capacity
            ):
                counts.add_pinned(b)
                groups.append((version, b, True))
        elif flow_feasible([*groups, (version, v + eta, False)], version, eta + 1, batch, capacity):
            counts.add_reserved(v)
            groups.append((version, v + eta, False))
    return counts, groups


@settings(max_examples=300, deadline=None)
@given(states(), st.integers(0, 4))
def test_admissible_iff_an_assignment_exists(state, back):
    counts, groups = state
    v_new = counts.version - back
    n = counts.eta + 1
    # Occupied groups may move earlier, never later: window [version, committed buffer].
    expected = v_new + counts.eta >= counts.version and flow_feasible(
        [*groups, (v_new, v_new + counts.eta, False)],
        counts.version,
        n,
        counts.batch_size,
        counts.capacity,
    )
    assert counts.admissible(v_new) == expected


@settings(max_examples=300, deadline=None)
@given(states())
def test_repack_is_the_lexicographically_earliest_packing(state):
    counts, groups = state
    n = counts.eta + 1
    got = counts.repack()
    assert got is not None
    best = brute_lexmax_occupied(groups, counts.version, n, counts.batch_size, counts.capacity)
    assert tuple(got) == best


@settings(max_examples=300, deadline=None)
@given(states(), st.integers(0, 3))
def test_repack_with_a_new_occupied_group(state, deadline):
    counts, groups = state
    n = counts.eta + 1
    deadline = min(deadline, counts.eta)
    got = counts.repack(extra_at=deadline)
    trial = [*groups, (counts.version, counts.version + deadline, True)]
    best = brute_lexmax_occupied(trial, counts.version, n, counts.batch_size, counts.capacity)
    assert (None if got is None else tuple(got)) == best
