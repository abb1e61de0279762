"""The control actor's clients (``runtime/controller/clients.py``,
``runtime/workers/control_client.py``): every call to the actor goes through them, each
reaches the actor method it names with its arguments, and the blocking, polled and
fire-and-forget calls keep those manners. The actor is a plain object behind Ray's
calling convention (``tests/staleflow/runtime/fakes.py``); no Ray.

The first tests read the library's source with :mod:`ast`: a ``.remote(`` call of a
``ControlActor`` method outside the client modules fails them."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from staleflow.runtime.controller.clients import (
    DriverControl,
    Reply,
    ScalingControl,
    SupervisorControl,
)
from staleflow.runtime.interface import StopRequested
from staleflow.runtime.workers.control_client import WorkerControl
from tests.staleflow.runtime.fakes import Actor, ActorDied, FakeRay

ROOT = Path(__file__).resolve().parents[4]
LIBRARY = ("staleflow", "staleness", "coordinator", "trajectory_server", "parameter_server")
ACTOR = Path("staleflow/runtime/controller/actor.py")
CLIENTS = {
    Path("staleflow/runtime/controller/clients.py"),
    Path("staleflow/runtime/workers/control_client.py"),
}
KNOWN: set[Path] = set()  # modules allowed a raw call for now: none


# -- no raw .remote() to the control actor -------------------------------------------------


def _trees() -> Iterator[tuple[Path, ast.Module]]:
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT), ast.parse(path.read_text(), filename=str(path))


def _calls(tree: ast.AST) -> list[ast.Call]:
    """The ``<x>.remote(...)`` and ``<x>.spawn(...)`` calls of a module (one walk)."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("remote", "spawn")
    ]


TREES = dict(_trees())
CALLS = {path: _calls(tree) for path, tree in TREES.items()}
CLASSES = {
    node.name: node
    for tree in TREES.values()
    for node in ast.walk(tree)
    if isinstance(node, ast.ClassDef)
}


def _methods(cls: ast.ClassDef) -> set[str]:
    return {
        f.name
        for f in cls.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and not f.name.startswith("_")
    }


CONTROL_METHODS = _methods(CLASSES["ControlActor"])


def _actor_classes() -> set[str]:
    """The library's classes made Ray actors: ``ray.remote(Cls)``, ``ctx.spawn(Cls, ...)``."""
    return {
        call.args[0].id
        for calls in CALLS.values()
        for call in calls
        if call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in CLASSES
    }


def _all_methods(name: str) -> set[str]:
    """A class's public methods with those of its bases in the library."""
    cls = CLASSES[name]
    out = _methods(cls)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in CLASSES:
            out |= _all_methods(base.id)
    return out


# a name another actor has too (``stop``) is the control actor's only on a receiver that
# says so (``control.stop.remote()``); any other is the control actor's wherever it is
SHARED = CONTROL_METHODS & {m for a in _actor_classes() - {"ControlActor"} for m in _all_methods(a)}


def raw_control_calls(calls: list[ast.Call], *, named: bool = True) -> list[tuple[int, str]]:
    """(line, call) of each ``<receiver>.<ControlActor method>.remote(...)`` among
    ``calls``; with ``named``, a method in :data:`SHARED` counts only on a receiver whose
    name says ``control``."""
    found = []
    for node in calls:
        method = node.func.value if isinstance(node.func, ast.Attribute) else None
        if not (
            isinstance(node.func, ast.Attribute)
            and node.func.attr == "remote"
            and isinstance(method, ast.Attribute)
            and method.attr in CONTROL_METHODS
        ):
            continue
        if named and method.attr in SHARED and "control" not in ast.unparse(method.value).lower():
            continue
        found.append((node.lineno, ast.unparse(node.func)))
    return sorted(found)


def test_the_scan_knows_the_actor_and_finds_a_raw_call():
    # it can fail: the actor's methods are read, and calls written the usual ways are found
    assert {"attach", "take_lost", "join", "note", "request_scale", "stop"} <= CONTROL_METHODS
    assert {"RolloutActor", "ControlActor", "ParameterServerActor"} <= _actor_classes()
    assert "stop" in SHARED and "take_lost" not in SHARED
    code = (
        "ray.get(run.control.control.note.remote('x', 'y'))\n"
        "h = self.handle\n"
        "h.take_lost.remote()\n"
        "control.stop.remote()\n"
        "instance.stop.remote()\n"  # another actor's stop
        "actor.version.remote()\n"  # not a control actor method
    )
    found = raw_control_calls(_calls(ast.parse(code)))
    assert [line for line, _ in found] == [1, 3, 4]


def test_no_raw_remote_to_the_control_actor_outside_its_clients():
    raw = [
        f"{path}:{line}: {call}"
        for path in TREES
        if path not in CLIENTS | KNOWN
        for line, call in raw_control_calls(CALLS[path])
    ]
    assert not raw, (
        "call the control actor through its clients (staleflow/runtime/controller/"
        "clients.py; the workers' in runtime/workers/control_client.py):\n" + "\n".join(raw)
    )


def test_every_actor_method_has_a_client():
    reached = {
        call.split(".")[-2]
        for path in CLIENTS
        for _, call in raw_control_calls(CALLS[path], named=False)
    }
    assert reached == CONTROL_METHODS, (
        f"ControlActor methods no client calls: {sorted(CONTROL_METHODS - reached)}"
    )


# -- the clients against a fake actor -------------------------------------------------------


class _Plane:
    """Records each call of the actor; answers from ``answers`` (an exception is raised)."""

    def __init__(self, **answers: object) -> None:
        self.calls: list[tuple[str, tuple[object, ...], dict[str, object]]] = []
        self.answers = answers

    def __getattr__(self, name: str):
        def method(*args: object, **kwargs: object) -> object:
            self.calls.append((name, args, kwargs))
            answer = self.answers.get(name)
            if isinstance(answer, Exception):
                raise answer
            return answer

        return method


class _CountingRay(FakeRay):
    """Counts the waits for an answer (a fire-and-forget call makes none) and their
    time-outs; ``ready`` says what a ``wait`` finds done."""

    def __init__(self, ready: bool = True) -> None:
        self.gets: list[float | None] = []
        self.ready = ready

    def get(self, ref, timeout: float | None = None):
        self.gets.append(timeout)
        return super().get(ref, timeout)

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None):
        return (list(refs), []) if self.ready else ([], list(refs))


def test_the_run_s_calls_reach_the_actor_and_wait_as_before():
    plane = _Plane(pending_cut=None, eval_due=7, settle={0: "h0"}, records=["r"])
    ray = _CountingRay()
    control = DriverControl(Actor(plane), ray)
    control.attach({0: ("h0", "0.0")}, {"ps/0": "e"}, None, {"v": 1}, [{"step": 1.0}])
    control.set_placement({"nodes": []})
    assert control.records(3) == ["r"] and control.pending_cut() is None
    assert control.eval_due() == 7 and control.settle() == {0: "h0"}
    control.eval_done(7, None)
    control.lost(2, "gone")
    control.request_stop()
    control.stop(timeout_s=10)
    assert [c[0] for c in plane.calls] == [
        "attach",
        "set_placement",
        "records",
        "pending_cut",
        "eval_due",
        "settle",
        "eval_done",
        "lost",
        "request_stop",
        "stop",
    ]
    assert plane.calls[0][1] == ({0: ("h0", "0.0")}, {"ps/0": "e"}, None, {"v": 1}, [{"step": 1.0}])
    assert plane.calls[2][1] == (3,) and plane.calls[7][1] == (2, "gone")
    assert len(ray.gets) == 10 and ray.gets[-1] == 10  # each waited; stop with its time-out


def test_posted_calls_reach_the_actor_and_nobody_waits():
    plane = _Plane()
    ray = _CountingRay()
    control = DriverControl(Actor(plane), ray)
    control.post_note("checkpoint", "run", "ckpt-3", n=1.0)
    control.post_release_cut(3)
    assert plane.calls == [
        ("note", ("checkpoint", "run", "ckpt-3"), {"n": 1.0}),
        ("release_cut", (3,), {}),
    ]
    assert ray.gets == []


def test_the_supervisor_polls_its_joins_and_replays():
    plane = _Plane(take_lost=["lost"], replay_completions=4, remove=2, take_scale=3)
    ray = _CountingRay(ready=False)
    control = SupervisorControl(Actor(plane), ray)
    join = control.submit_join(5, "actor", "5.1", 9, "instance_restarted")
    replay = control.submit_replay_completions()
    assert isinstance(join, Reply) and not join.done() and not replay.done()
    assert ray.gets == []  # submitted, not waited for
    ray.ready = True
    assert join.done() and join.result() is None and replay.result() == 4
    assert plane.calls[0] == ("join", (5, "actor", "5.1", 9, "instance_restarted"), {})
    assert control.take_lost() == ["lost"] and control.remove(5) == 2
    assert control.take_scale() == 3
    control.note("ps_lost", "ps/0", "died", reassigned=2.0)
    assert plane.calls[-1] == ("note", ("ps_lost", "ps/0", "died"), {"reassigned": 2.0})


def test_a_failed_request_raises_when_its_reply_is_read():
    control = SupervisorControl(Actor(_Plane(join=ActorDied("the control actor died"))), FakeRay())
    reply = control.submit_join(1, "a", "1.0", 0, "instance_added")
    with pytest.raises(ActorDied, match="died"):
        reply.result()


def test_scaling_asks_with_its_time_out_and_answers_in_words():
    members = {0: ("0.0", "h0"), 1: ("1.0", "h1")}
    plane = _Plane(members=members, request_scale="asked for 3", staleness={0: 4}, live="L")
    ray = _CountingRay()
    control = ScalingControl(Actor(plane), ray)
    assert len(control.members(timeout_s=30)) == 2
    assert control.request_scale(3, timeout_s=30) == "asked for 3"
    assert control.staleness() == {0: 4}
    live, records = control.submit_live(), control.submit_records(12)
    assert live.result(5) == "L" and records.result(5) is None
    assert plane.calls[1] == ("request_scale", (3,), {})
    assert plane.calls[-1] == ("records", (12,), {})
    assert ray.gets == [30, 30, None, 5, 5]


class _TaskError(Exception):
    """Stands in for ``ray.exceptions.RayTaskError``: the actor's exception as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _TaskRay(FakeRay):
    class exceptions(FakeRay.exceptions):
        RayTaskError = _TaskError

    def get(self, ref, timeout: float | None = None):
        if ref.error is not None:
            raise _TaskError(ref.error)
        return ref.value


def test_the_trainer_s_consume_refused_at_a_stop_is_stop_requested():
    plane = _Plane(consume=StopRequested("the run is stopping"), trainer_groups="g")
    control = WorkerControl(Actor(plane), _TaskRay())
    with pytest.raises(StopRequested, match="stopping"):
        control.consume(4, 1.0)
    assert control.trainer_groups(4, 0, 0.5) == "g"
    other = WorkerControl(Actor(_Plane(consume=ValueError("bad"))), _TaskRay())
    with pytest.raises(_TaskError):  # any other failure is Ray's, unchanged
        other.consume(4)
    control.rewarded(iter(["a", "b"]))
    control.dropped(iter(["t"]))
    assert plane.calls[-2:] == [("rewarded", (["a", "b"],), {}), ("dropped", (["t"],), {})]
