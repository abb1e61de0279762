"""Recovery wired in one process with threads (docs/recovery.md): the real control plane,
TS, staleness manager, coordinator, instance hosts, reward stage and training loop, with
the fake engine, trainer, PS and reward function of ``fakes.py``. No Ray.

What must hold: a lost instance costs only what it generated since its last progress
report and the run goes on; a Route that died with its instance leaks no reservation;
an instance leaves (elastic rollout) with its partial responses whole and a new one is
routed to at the next cycle; a stop interrupts everything and takes a consistent cut
from which the run resumes to its step count within eta, every interrupted partial
continuing from its tokens.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from coordinator import CoordinatorConfig
from staleflow.recovery import RunState, read_checkpoint, write_checkpoint
from staleflow.recovery.restore import restore_run
from staleflow.runfolder.step_record import StepRecord
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.in_process import Serialized
from staleflow.runtime.interface import InstanceGone
from staleflow.runtime.workers.instance_host import InstanceHost
from staleflow.runtime.workers.reward_stage import RewardStage
from staleflow.runtime.workers.training_loop import TrainingLoop
from staleness import StalenessConfig, StalenessManager
from tests.staleflow.recovery.runs import Prompts
from tests.staleflow.runtime.fakes import (
    CountingTrainer,
    MemoryPS,
    ScriptedEngine,
    SyncPusher,
    parity_scorer,
)
from trajectory_server import TrajectoryServer, TrajectoryServerConfig, TrajState

ETA, BATCH, GROUP = 2, 2, 2


@dataclass
class Wired:
    control: ControlPlane
    ts: Serialized
    hosts: dict[int, InstanceHost]
    engines: dict[int, Throttled]
    loop: TrainingLoop
    trainer: CountingTrainer
    ps: MemoryPS
    on_finished: Callable[[list], None]
    pool: ThreadPoolExecutor
    threads: list[threading.Thread] = field(default_factory=list)


class Throttled(ScriptedEngine):
    """The fake engine, stepping only ``budget`` more times (None: no limit), and failing
    every step once ``fail`` is set, as a crashed engine does."""

    def __init__(self, target: int, budget: int | None = None) -> None:
        super().__init__(target=target, max_running=3)
        self.budget = budget
        self.fail = ""

    def step(self):
        if self.fail:
            raise RuntimeError(self.fail)
        if self.budget is not None:
            if self.budget <= 0:
                return []
            self.budget -= 1
        return super().step()

    @property
    def has_work(self) -> bool:
        if self.fail:
            return True
        return (self.budget is None or self.budget > 0) and super().has_work


def wake(h: InstanceHost) -> None:
    """The generation thread sleeps until a command arrives; a changed budget is one."""
    with h.instance._lock:
        h.instance._work.notify_all()


def protocol() -> StalenessConfig:
    return StalenessConfig(eta=ETA, batch_size=BATCH, group_size=GROUP)


def ts_config() -> TrajectoryServerConfig:
    return TrajectoryServerConfig(ETA, BATCH, GROUP)


def wire(
    *,
    targets: dict[int, int],
    budgets: dict[int, int] | None = None,
    checkpoint_every: int = 0,
    ts: TrajectoryServer | None = None,
    manager: StalenessManager | None = None,
    trainer_version: int = 0,
    records=(),
) -> Wired:
    """Instances ``i`` whose trajectories run to ``targets[i]`` tokens (plus a spread),
    with holder ids ``i.0``; a resumed run passes the restored ``ts`` and ``manager``."""
    served = Serialized(ts if ts is not None else TrajectoryServer(ts_config(), Prompts()))
    ps = MemoryPS(versions={trainer_version: {}})
    box: list[ControlPlane] = []
    stage = RewardStage(
        parity_scorer, lambda tokens: "a" * len(tokens), served, lambda r: box[0].rewarded(r)
    )
    lock = threading.Lock()

    def on_finished(finished):
        with lock:
            stage.process(finished)

    engines = {i: Throttled(t, (budgets or {}).get(i)) for i, t in targets.items()}
    hosts = {i: host(i, engines[i], served, ps, on_finished) for i in targets}
    pool = ThreadPoolExecutor(4)
    control = ControlPlane(
        ControlConfig(
            protocol(),
            # no migration: what moves a trajectory off an instance is what is tested
            CoordinatorConfig(period_s=0.005, migration="vanilla"),
            idle_wait_s=0.002,
            checkpoint_every=checkpoint_every,
        ),
        ts=served,
        instances=hosts,
        holders={i: h.holder for i, h in hosts.items()},
        versions=dict.fromkeys(hosts, trainer_version),
        ps_version=ps.latest,
        run_round=lambda actions: list(pool.map(lambda a: a(), actions)),
        manager=manager,
        records=records,
    )
    box.append(control)
    trainer = CountingTrainer()
    trainer.version = trainer_version
    loop = TrainingLoop(trainer, control=control, ts=served, pusher=SyncPusher(ps))
    return Wired(control, served, hosts, engines, loop, trainer, ps, on_finished, pool)


def host(i, engine, ts, ps, on_finished, incarnation: int = 0) -> InstanceHost:
    return InstanceHost(
        i,
        engine,
        ts=ts,
        weights=ps,
        max_response=64,
        on_finished=on_finished,
        holder=f"{i}.{incarnation}",
    )


def start(w: Wired, steps: int) -> dict:
    """Start everything and train ``steps`` steps on a thread; ``out["reports"]``."""
    for h in w.hosts.values():
        h.start(w.trainer.version)
    w.control.start()
    out: dict = {}

    def train() -> None:
        try:
            out["reports"] = w.loop.run(steps)
        except BaseException as exc:  # surfaced by finish()
            out["error"] = exc

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    w.threads.append(thread)
    return out


def finish(w: Wired, out: dict, timeout: float = 120.0) -> list:
    for t in w.threads:
        t.join(timeout)
        assert not t.is_alive(), "the trainer did not finish"
    w.control.stop()
    for h in w.hosts.values():
        h.stop()
    w.pool.shutdown()
    if "error" in out:
        raise out["error"]
    return out["reports"]


def wait_for(condition: Callable[[], object], what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def check_bounded_and_once(reports, batches) -> Counter[int]:
    seen: Counter[int] = Counter()
    for r, batch in zip(reports, batches, strict=True):
        for g in batch.groups:
            for t in g.trajectories:
                seen[t.traj_id] += 1
                assert r.version - t.v_traj <= ETA
                assert (t.versions >= t.v_traj).all()
    assert max(seen.values()) == 1, "a trajectory was consumed twice"
    return seen


def holds(e: Throttled) -> bool:
    state = e.state()
    return bool(state.running or state.waiting)


def reserved_members(manager: StalenessManager) -> dict[int, int]:
    """traj -> V_traj of every member of a group not yet occupied."""
    return {
        t: v
        for g in manager.export_state()["groups"]
        if g["buffer"] is None
        for t, v in g["members"]
    }


# -- a lost instance ---------------------------------------------------------------------------


def test_a_lost_instance_costs_only_the_tokens_since_its_last_report():
    # instance 0 takes 5 steps and stalls; instance 1 waits. Nothing finishes, the PS
    # stays at version 0, so nothing but the loss moves instance 0's trajectories.
    w = wire(targets={0: 200, 1: 4}, budgets={0: 5, 1: 0})
    out = start(w, 6)
    h0, e0 = w.hosts[0], w.engines[0]
    wait_for(lambda: e0.budget == 0 and e0.state().running, "instance 0 to stall")
    assert h0.report_progress() >= 1  # what the TS now knows of instance 0's work
    ledger = {t.traj_id: t for t in w.ts.ledger()}
    reported = {tid: ledger[tid].tokens for tid, _ in e0.state().running}
    held = len(e0.state().running) + len(e0.state().waiting)  # the waiting ones: 0 tokens
    assert reported and set(reported.values()) == {5}
    v_traj = {tid: ledger[tid].v_traj for tid in reported}
    e0.fail = "engine exploded"  # its next step fails, as a crashed engine's does
    e0.budget = None
    wake(h0)
    wait_for(lambda: 0 not in w.control.members, "the loss to be handled")
    requeued = {t.traj_id: t for t in w.ts.ledger() if t.traj_id in reported}
    assert all(t.state is TrajState.QUEUED and t.tokens == 5 for t in requeued.values())
    assert {tid: t.v_traj for tid, t in requeued.items()} == v_traj  # V_traj kept
    assert {
        tid: v for tid, v in reserved_members(w.control.manager).items() if tid in reported
    } == v_traj  # and the reservations
    w.engines[1].budget = None
    wake(w.hosts[1])
    reports = finish(w, out)
    assert len(reports) == 6
    check_bounded_and_once(reports, w.trainer.batches)
    consumed = {t.traj_id: t for b in w.trainer.batches for g in b.groups for t in g.trajectories}
    for tid in set(reported) & set(consumed):  # instance 1 continued after the 5 tokens
        t = consumed[tid]
        assert t.v_traj == v_traj[tid] and len(t.tokens) > 5 and t.tokens[:5].tolist() == [7] * 5
        assert t.versions[:5].tolist() == [0] * 5
    assert set(reported) & set(consumed), "no requeued trajectory was trained on"
    assert w.ts.routed_to("0.0") == ()
    events = [e for e in w.control.events() if e.kind == "instance_lost"]
    assert [e.subject for e in events] == ["instance/0"] and "engine exploded" in events[0].detail
    last = w.control.records()[-1].extra
    assert last["recovery/instance_lost"] == 1.0
    assert last["recovery/tokens_kept"] == 5 * len(reported)
    assert last["recovery/requeued"] == held
    assert w.control.take_lost()[0].holder == "0.0"  # for the supervisor


def test_a_route_that_died_with_its_instance_gives_its_reserves_back():
    """The instance dies before it fetched its routed trajectories from the TS: they are
    still initial there, so the Reserves made for them must go back, or their groups
    would be stuck with a reservation no trajectory fills."""
    w = wire(targets={0: 4, 1: 4})
    failing: list[list[int]] = []

    def dies_before_fetching(traj_ids, v_traj):
        failing.append(list(v_traj))
        raise InstanceGone(0, "the process died")

    w.hosts[0].route = dies_before_fetching  # type: ignore[method-assign]
    out = start(w, 4)
    wait_for(lambda: failing and 0 not in w.control.members, "a Route to the dying instance")
    assert failing[0], "the Route carried no Reserve"
    wait_for(lambda: len(w.control.records()) >= 4, "four steps on instance 1")
    w.control.request_stop()  # freeze the manager and the TS for the check
    reports = finish(w, out)
    check_bounded_and_once(reports, w.trainer.batches)
    # every reservation of a group still filling is held by a trajectory with that V_traj
    ledger = {t.traj_id: t for t in w.ts.ledger()}
    for tid, v in reserved_members(w.control.manager).items():
        assert tid in ledger and ledger[tid].v_traj == v, (tid, v, ledger.get(tid))
    consumed = {t.traj_id for b in w.trainer.batches for g in b.groups for t in g.trajectories}
    for tid in failing[0]:  # trained on, or back in the TS as initial or re-reserved
        assert tid in consumed or tid in ledger


# -- elastic rollout -------------------------------------------------------------------------


def test_instances_leave_with_their_partials_whole_and_join_at_the_next_cycle():
    w = wire(targets={0: 200, 1: 4}, budgets={0: 3, 1: 0})
    out = start(w, 8)
    e0 = w.engines[0]
    wait_for(lambda: e0.budget == 0 and e0.state().running, "instance 0 to stall")
    on_0 = {tid: n - 0 for tid, n in e0.state().running}
    returned = w.control.remove(0).result(30)
    assert returned >= len(on_0) and 0 not in w.control.members
    assert w.hosts[0].held() == set() and w.ts.routed_to("0.0") == ()
    ledger = {t.traj_id: t for t in w.ts.ledger()}
    # their responses came back whole (3 tokens each): nothing to regenerate
    assert all(ledger[tid].state is TrajState.QUEUED and ledger[tid].tokens == 3 for tid in on_0)
    # a newcomer (Pulled the current version on start) is routed to at the next cycle
    e2 = Throttled(4)
    h2 = host(2, e2, w.ts, w.ps, w.on_finished)
    h2.start(w.ps.latest())
    w.hosts[2] = h2
    w.control.join(2, h2, h2.holder, e2.state().version).result(30)
    wait_for(lambda: e2.times().decode_tokens > 0, "the newcomer to generate")
    with pytest.raises(KeyError, match="not in the run"):
        w.control.remove(0).result(30)
    w.engines[1].budget = None
    wake(w.hosts[1])
    reports = finish(w, out)
    check_bounded_and_once(reports, w.trainer.batches)
    kinds = [e.kind for e in w.control.events()]
    assert kinds.count("instance_removed") == 1 and kinds.count("instance_added") == 1


# -- checkpoints, stop and resume ------------------------------------------------------------


def test_a_periodic_cut_holds_the_next_consume_until_it_is_written():
    w = wire(targets={0: 4, 1: 5}, checkpoint_every=2)
    out = start(w, 4)
    cut = wait_for(w.control.pending_cut, "the cut after step 2")
    assert (cut.steps, cut.version, cut.final) == (2, 2, False)
    assert cut.staleness["version"] == 2 and len(cut.metrics) == 2
    # the trainer asks for buffer 2 and is not served while the cut is pending
    wait_for(lambda: w.control._consume is not None, "the trainer's next Consume")
    assert w.control.manager.version == 2 and len(w.control.records()) == 2
    w.control.release_cut(2)
    second = wait_for(lambda: (c := w.control.pending_cut()) and c.steps == 4 and c, "step 4")
    w.control.release_cut(second.steps)
    assert len(finish(w, out)) == 4


def test_stop_cut_and_resume_keep_every_partial_and_the_bound(tmp_path):
    steps = 8
    w = wire(targets={0: 30, 1: 12})
    out = start(w, steps)
    wait_for(lambda: len(w.control.records()) >= 2, "two steps")
    # freeze both engines, then let instance 0 take two steps: at the stop it holds
    # partial responses, and nothing can finish them before the stop interrupts it
    e0, e1 = w.engines[0], w.engines[1]
    e1.budget = e0.budget = 0
    deadline = time.monotonic() + 120
    while not any(n > 0 for _, n in e0.state().running):
        assert time.monotonic() < deadline, "instance 0 never held a partial response"
        # instance 0 may hold nothing at the freeze (the bound full of instance 1's
        # trajectories): then one step of instance 1 lets the run go on until 0 is routed to
        if not holds(e0) and not holds(e1):  # a Route is on its way
            time.sleep(0.005)
            continue
        i = 0 if holds(e0) else 1
        e = w.engines[i]
        e.budget = 2 if i == 0 else 1
        wake(w.hosts[i])
        wait_for(lambda e=e: e.budget == 0 or not holds(e), f"a step of instance {i}")
    w.control.request_stop()
    first = finish(w, out)
    cut = w.control.pending_cut()
    assert cut is not None and cut.final and cut.version == w.trainer.version == cut.steps
    assert len(first) == cut.steps < steps
    states = Counter(cut.trajectories["trajectories"]["state"])
    assert states["routed"] == 0  # every instance was interrupted: partials are whole
    state = RunState(
        cut.steps, cut.version, cut.ps_version, cut.staleness, cut.trajectories, cut.metrics
    )
    write_checkpoint(tmp_path, state, trainer=lambda p: p.mkdir())
    ck = read_checkpoint(tmp_path, protocol=protocol())
    # the manager restored from the checkpoint is the one written, field by field
    assert StalenessManager.restore(dict(ck.staleness)).export_state() == dict(ck.staleness)
    manager, ts, _ = restore_run(ck, ts_config(), Prompts(**ck.sampler))
    t = ck.trajectories["trajectories"]
    offsets = t["offsets"]
    saved = {
        tid: t["tokens"][offsets[k] : offsets[k + 1]].tolist()
        for k, tid in enumerate(t["id"].tolist())
        if t["state"][k] == "queued" and offsets[k + 1] > offsets[k]
    }
    assert saved, "the stop interrupted no partial response (make the responses longer)"

    w2 = wire(
        targets={0: 30, 1: 12},
        ts=ts,
        manager=manager,
        trainer_version=ck.version,
        records=[StepRecord.from_flat(r) for r in ck.metrics],
    )
    out2 = start(w2, steps - ck.steps)
    second = finish(w2, out2)
    assert len(first) + len(second) == steps  # the same number of steps in all
    assert [r.version for r in second] == list(range(ck.steps, steps))
    records = w2.control.records()
    assert [r.step for r in records] == list(range(1, steps + 1))  # metrics continue
    seen = check_bounded_and_once(second, w2.trainer.batches)
    before = {t.traj_id for b in w.trainer.batches for g in b.groups for t in g.trajectories}
    assert not before & set(seen)  # nothing consumed before is consumed again
    live = {e.traj_id: e for e in w2.ts.ledger()}
    after = {t.traj_id: t for b in w2.trainer.batches for g in b.groups for t in g.trajectories}
    for tid, prefix in saved.items():  # every interrupted partial resumed from its tokens
        if tid in after:
            assert after[tid].tokens[: len(prefix)].tolist() == prefix
        else:
            assert tid not in live or live[tid].tokens >= len(prefix)
    stats = w2.ts.stats()  # the TS's counters went on across the resume
    assert stats.consumed_trajectories == len(before) + len(seen)
    assert stats.created_trajectories == (
        stats.consumed_trajectories + stats.aborted_trajectories + len(live)
    )


def test_progress_reports_send_only_what_grew_and_the_ts_keeps_it():
    ts = Serialized(TrajectoryServer(ts_config(), Prompts()))
    engine = Throttled(200, budget=0)
    h = host(0, engine, ts, MemoryPS(), lambda finished: None)
    h.start(0)
    try:
        assert h.route([0, 1], {0: 0, 1: 0}) == (0, 1)
        assert h.report_progress() == 0  # nothing generated yet
        engine.budget = 4
        wake(h)
        wait_for(lambda: engine.budget == 0, "4 engine steps")
        assert h.report_progress() == 2
        assert [t.tokens for t in ts.ledger()[:2]] == [4, 4]
        assert h.report_progress() == 0  # nothing grew since
        engine.budget = 2
        wake(h)
        wait_for(lambda: engine.budget == 0, "2 more steps")
        assert h.report_progress() == 2
        assert [t.tokens for t in ts.ledger()[:2]] == [6, 6]
        ts.instance_lost("0.0")  # declared lost: its reports are ignored from now on
        engine.budget = 1
        wake(h)
        wait_for(lambda: engine.budget == 0, "1 more step")
        assert h.report_progress() == 0
        assert [t.tokens for t in ts.ledger()[:2]] == [6, 6]
        with pytest.raises(InstanceGone, match="declared lost"):
            h.route([2], {2: 0})  # and its Routes refused: this incarnation must stop
    finally:
        h.stop()
