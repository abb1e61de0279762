"""Background Push, overlapped with the next training step (paper §5.1, Fig. 21).

The trainer hands its freshly updated weights to :meth:`BackgroundPusher.push_async`
and goes on with the next step; one background thread copies them into the PS.
The copy (``np.copyto`` or a transport's send) releases the GIL, so it runs
beside a training step that also releases it. The trainer must not modify the
weights it handed over until the handle says so: it calls
``handle.before_overwrite()`` right before its optimizer writes new values.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from parameter_server.store import Weights

logger = logging.getLogger(__name__)


class PushTarget(Protocol):
    """Anything that takes a whole version: a VersionedStore or a transport client."""

    def push(self, weights: Weights, version: int | None = None) -> int: ...


@dataclass(frozen=True)
class PushTiming:
    """Where a background Push spent its time (seconds)."""

    queued_s: float
    copy_s: float


class PushHandle:
    """Completion handle of one background Push."""

    def __init__(self, version: int | None) -> None:
        self.requested_version = version
        self._future: Future[int] = Future()
        self.timing: PushTiming | None = None

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until the Push is published; return its version or raise its error."""
        return self._future.result(timeout)

    def before_overwrite(self, timeout: float | None = None) -> int:
        """Fence: call before modifying the weights that were handed to push_async."""
        return self.wait(timeout)

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None


class BackgroundPusher:
    """Runs Pushes one at a time on a background thread, in submission order."""

    def __init__(self, target: PushTarget, name: str = "ps-push") -> None:
        self._target = target
        self._queue: queue.SimpleQueue[tuple[PushHandle, Weights, float] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def push_async(self, version: int | None, weights: Weights) -> PushHandle:
        """Start publishing ``weights`` as ``version``; returns at once."""
        if self._closed:
            raise RuntimeError("push_async after close(); create a new BackgroundPusher")
        handle = PushHandle(version)
        self._queue.put((handle, weights, time.perf_counter()))
        return handle

    def close(self, timeout: float | None = None) -> None:
        """Finish queued Pushes and stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            handle, weights, submitted = item
            started = time.perf_counter()
            try:
                version = self._target.push(weights, handle.requested_version)
            except BaseException as exc:  # handed to the trainer through the handle
                logger.warning(
                    "background push of version %s failed: %s", handle.requested_version, exc
                )
                handle._future.set_exception(exc)
            else:
                handle.timing = PushTiming(started - submitted, time.perf_counter() - started)
                handle._future.set_result(version)
