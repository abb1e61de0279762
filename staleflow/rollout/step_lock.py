"""The lock between an engine's generation thread and the control calls made on it.

The generation thread takes the lock for a step, releases it and takes it again for the
next at once. A plain ``threading.Lock`` is not fair: the thread that releases it usually
wins it back before a waiting control call has even woken, so a route, interrupt or
snapshot can wait many steps (a coordinator's cycle stalled for seconds behind a slow
instance). Here a control call announces itself before it waits, and the generation
thread lets every announced call in before its next step: a call waits at most for the
step in progress, as SGLang's scheduler applies requests between forward passes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class StepLock:
    """``with lock:`` for a control call; ``with lock.step():`` for the generation thread;
    ``lock.work``: the condition the generation thread waits on for work (notify it under
    ``with lock:``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.work = threading.Condition(self._lock)
        self._gate = threading.Condition(threading.Lock())
        self._calls = 0  # control calls announced and not yet holding the lock

    def __enter__(self) -> StepLock:
        with self._gate:
            self._calls += 1
        try:
            self._lock.acquire()
        finally:
            with self._gate:
                self._calls -= 1
                if not self._calls:
                    self._gate.notify_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lock.release()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The generation thread's turn: after every control call that is waiting."""
        with self._gate:
            while self._calls:
                self._gate.wait()
        with self._lock:
            yield
