"""Run every method of a single-threaded object under one lock: what a Ray actor with
``max_concurrency=1`` gives its core, for components wired together in one process."""

from __future__ import annotations

import threading
from typing import Any


class Serialized:
    def __init__(self, target: object) -> None:
        self._target = target
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> Any:
            with self._lock:
                return attr(*args, **kwargs)

        return call
