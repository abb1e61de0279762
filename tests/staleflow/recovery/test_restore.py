"""Restoring a run: the manager and the TS agree, routed work resumes from its tokens and
the first buffers after the resume stay within eta."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from staleflow.control.dynamic_sampling import SamplingConfig
from staleflow.recovery import CorruptCheckpoint, read_checkpoint, write_checkpoint
from staleflow.recovery.restore import reconcile, restore_run
from tests.staleflow.recovery.runs import Prompts, Run, busy_run, token
from trajectory_server import TrajState


def resume(run: Run, tmp_path, state=None) -> Run:
    """Write the run's checkpoint, read it back and restore it, as ``--resume`` will."""
    write_checkpoint(tmp_path, state or run.state())
    ck = read_checkpoint(tmp_path, protocol=run.protocol)
    manager, ts, _ = restore_run(ck, run.ts.config, Prompts(ck.sampler["drawn"]))
    resumed = Run(run.protocol, manager, ts, ck.steps)
    resumed.group_of = dict(run.group_of)
    return resumed


def test_routed_work_resumes_from_its_tokens_with_its_reservation(tmp_path):
    run = busy_run()
    saved = run.state()
    resumed = resume(run, tmp_path)
    # the manager's state right after the restore equals the state written
    assert resumed.manager.export_state() == saved.staleness
    # 4 (5 tokens reported) and 5 (none) were routed to "a": queued again, V_traj kept
    assert resumed.ts.state_of(4) is TrajState.QUEUED and resumed.ts.state_of(5) is TrajState.QUEUED
    view = {r.traj_id: r for r in resumed.ts.routing_view()}
    assert (view[4].v_traj, view[4].length - view[4].prompt_len) == (1, 5)
    assert (view[5].v_traj, view[5].length - view[5].prompt_len) == (1, 0)
    assert resumed.ts.routed_to("a") == ()
    # an instance at the trainer's version continues them after the known prefix
    resumed.route([4, 5], resumed.manager.version, "new")
    assert resumed.held[4].tolist() == [1] * 5  # the 5 reported tokens, by version 1
    resumed.finish(4, 3, resumed.manager.version)
    resumed.finish(5, 2, resumed.manager.version)
    resumed.route([6], 1, "new")
    resumed.finish(6, 1, 1)
    batches = []
    while resumed.manager.is_ready():
        batches.append(resumed.manager.consume())
    assert batches and all(0 <= s <= run.protocol.eta for b in batches for s in b.staleness)
    taken = resumed.ts.take_batch([g.group_id for g in batches[0].groups])
    for group in taken.groups:
        for t in group.trajectories:  # each token exactly once, as first generated
            assert t.tokens.tolist() == [token(t.traj_id, p) for p in range(len(t.tokens))]
            assert t.versions.min() >= t.v_traj


def test_a_completion_stored_between_the_two_exports_is_replayed(tmp_path):
    run = Run.start(eta=1, batch=1, group=2)
    run.route([0, 1], 0, "a")
    run.finish(0, 2, 0)
    staleness = run.manager.export_state()  # the manager first ...
    run.finish(1, 3, 0, report=False)  # ... a reward lands in the TS ...
    state = replace(run.state(), staleness=staleness)  # ... then the TS
    resumed = resume(run, tmp_path, state)
    assert resumed.manager.is_ready()  # group 0 occupied by the replayed completion
    batch = resumed.manager.consume()
    assert [g.trajectories for g in batch.groups] == [(0, 1)] and batch.staleness == (0,)


def test_a_replayed_completion_filters_a_uniform_group_as_the_loop_would(tmp_path):
    """With dynamic sampling on, the group the replay completes has rewards 1.0 and 1.0
    (the TS's): dropped as filtered, not occupied, as the control loop would have."""
    run = Run.start(eta=1, batch=1, group=2)
    run.route([0, 1], 0, "a")
    run.finish(0, 2, 0)
    staleness = run.manager.export_state()
    run.finish(1, 3, 0, report=False)
    write_checkpoint(tmp_path, replace(run.state(), staleness=staleness))
    ck = read_checkpoint(tmp_path, protocol=run.protocol)
    sampling = SamplingConfig(batch_size=1)
    manager, ts, rec = restore_run(ck, run.ts.config, Prompts(ck.sampler["drawn"]), sampling)
    assert rec.replayed == (1,) and rec.filtered == (0, 1)
    assert not manager.is_ready() and manager.filtered_groups == 1
    s = ts.stats()
    assert (s.filtered_groups, s.filtered_trajectories, s.completed) == (1, 2, 0)


def test_exports_taken_without_pausing_the_control_loop_are_refused(tmp_path):
    run = Run.start(eta=1, batch=2, group=1)
    staleness = run.manager.export_state()
    run.route([0], 0, "a")  # a Reserve and a Route after the manager's export
    with pytest.raises(CorruptCheckpoint, match="has no such reservation"):
        resume(run, tmp_path / "one", replace(run.state(), staleness=staleness))
    run.finish(0, 1, 0, report=False)
    ts_state = run.ts.export_state()
    run.occupy(0)  # the manager exported after a completion the TS did not see
    bad = replace(run.state(), trajectories=ts_state)
    row = ts_state["trajectories"]["id"].tolist().index(0)
    ts_state["trajectories"]["state"][row] = "routed"  # as if the reward never reached the TS
    with pytest.raises(CorruptCheckpoint, match="completed in the manager but queued"):
        resume(run, tmp_path / "two", bad)


def test_reconcile_of_agreeing_states_changes_nothing():
    run = busy_run()
    before = run.manager.export_state()
    report = reconcile(run.manager, run.ts)
    assert report.replayed == () and report.aborted == ()
    assert run.manager.export_state() == before
    ids = run.state().trajectories["trajectories"]["id"]
    assert np.array_equal(run.ts.export_state()["trajectories"]["id"], ids)
