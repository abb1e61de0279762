"""The control plane's inbox (``runtime/controller/inbox.py``): a fleet change that fails
fails only its own future, and a loop that dies fails every ask still waiting in the inbox
with the plane's error, so nobody waits forever. The plane is the in-process one of
``test_runtime_inprocess`` (real TS, manager, coordinator), driven by hand; no threads."""

from __future__ import annotations

import pytest

from staleflow.runtime.controller import inbox
from staleflow.runtime.controller.control_plane import ControlPlaneError
from tests.staleflow.runtime.test_runtime_inprocess import wire


def test_an_ask_that_fails_fails_its_future_and_the_plane_goes_on():
    w = wire(1)
    removed = w.control.remove(99)
    replayed = w.control.replay_completions()
    w.control.run_once()
    with pytest.raises(KeyError, match="instance 99 is not in the run"):
        removed.result(timeout=0)
    assert replayed.result(timeout=0) == 0  # nothing was lost
    w.control.check()  # still serving


def test_a_loop_that_dies_fails_every_ask_waiting_in_the_inbox():
    w = wire(1)
    consume = w.control.request_consume(0)
    removed = w.control.remove(0)
    w.control.rewarded([])  # not an ask: nobody waits on it
    assert w.control._inbox.qsize() == 3

    def broken() -> None:
        raise RuntimeError("the coordinator broke")

    w.control.run_once = broken  # type: ignore[method-assign]
    w.control._serve()  # the loop's body, on this thread
    for future in (consume, removed):
        with pytest.raises(ControlPlaneError, match="the coordinator broke"):
            future.result(timeout=0)
    assert w.control._inbox.empty()
    with pytest.raises(ControlPlaneError):  # and every later call is refused
        w.control.request_stop()


def test_each_ask_carries_its_own_future():
    a, b = inbox.RemoveAsked(1), inbox.RemoveAsked(1)
    assert a.future is not b.future and isinstance(a, inbox.ASKS)
    assert not isinstance(inbox.StopAsked(), inbox.ASKS)
