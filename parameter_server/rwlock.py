"""A reader/writer lock: many concurrent Pulls of a slot, or one Push into it (paper §5.1)."""

from __future__ import annotations

import threading
import time


class RWLock:
    """Shared/exclusive lock without reentrancy.

    The store never lets a writer wait on a slot a new reader could still find
    (it retires the slot first), so writer starvation cannot happen and the lock
    needs no fairness policy of its own.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False

    @property
    def readers(self) -> int:
        return self._readers

    @property
    def writing(self) -> bool:
        return self._writer

    def try_acquire_read(self) -> bool:
        with self._cond:
            if self._writer:
                return False
            self._readers += 1
            return True

    def release_read(self) -> None:
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("release_read without a matching acquire")
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._writer or self._readers:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._writer = True
            return True

    def release_write(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_write without a matching acquire")
            self._writer = False
            self._cond.notify_all()
