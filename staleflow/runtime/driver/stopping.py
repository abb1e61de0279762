"""Stopping a run gracefully on Ctrl-C and SIGTERM (``docs/recovery.md``).

The first signal sets an event the launcher watches: the run interrupts its rollouts,
finishes the training step in progress, writes its checkpoint and ends. A second signal
is not caught: it stops the process at once (the previous checkpoint stays usable).
Handlers can only be installed from the main thread; elsewhere this does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def graceful_stop(
    stop: threading.Event, say: Callable[[str], None] | None = None
) -> Iterator[threading.Event]:
    """Within the block, SIGINT and SIGTERM set ``stop`` (once); the handlers that were
    installed before are put back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    before: dict[int, Any] = {}

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if say is not None:
            say(
                f"{name}: stopping after the step in progress and writing a checkpoint "
                f"(send {name} again to stop at once)"
            )
        for s, handler in before.items():  # the next one is not ours any more
            signal.signal(s, handler)
        stop.set()

    for s in SIGNALS:
        before[s] = signal.signal(s, handle)
    try:
        yield stop
    finally:
        for s, handler in before.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(s, handler)
