"""Runs a function in a child process, so that a time limit can be enforced.

A thread cannot be stopped in Python, and ``signal.alarm`` works only in the main thread,
while reward workers score from threads and Ray actors. A process can be killed: each
call waits at most ``timeout_s`` for its answer, and past that the child is killed and
a fresh one started for the next call. The child is spawned, not forked, because forking
a process that runs threads (any Ray actor) can deadlock the child.

:class:`TimeLimitedCall` is the mechanism, for any function that the child builds
itself (a reward function here; an environment's step in
:mod:`staleflow.runtime.workers.env_sandbox`); :class:`TimeLimitedRewardFn` is the
reward function's. With ``confine``, the child runs each call in a process forked for it
alone and confined (:mod:`staleflow.rewards.confinement`), and enforces the limit
itself by killing that process's group; the child lives on.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import signal
import threading
import weakref
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from staleflow.rewards.base import RewardError, RewardTimeout, as_reward
from staleflow.rewards.confinement import Limits, Reply, call_confined, probe
from staleflow.rewards.registry import load_factory

logger = logging.getLogger(__name__)

_CONFINED_GRACE_S = 10.0  # a confined call's fork, kill and clean-up, past its own limit

# What the child serves: ``build(*args)`` returns the function each call runs. ``build``
# must be a module-level function (the spawned child imports it by name).
Build = Callable[..., Callable[..., Any]]


class CallError(RuntimeError):
    """The function raised in the child (the message is its error), or the child died."""


class CallOutOfMemory(CallError):
    """A confined call ran out of its address space (the message says its limit)."""


class CallTimeout(RuntimeError):
    """A call ran past its limit; its child was killed. (Not a TimeoutError: that is an
    OSError, which the call takes for a dead pipe.)"""


def _serve(
    conn: Connection, build: Build, args: tuple[Any, ...], confine: tuple[Limits, float] | None
) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when the child stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = build(*args)
        notes = probe(confine[0]) if confine else ()
    except BaseException as exc:
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", notes))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if request is None:
            return
        if confine is not None:
            conn.send(_answer(call_confined(fn, request, *confine), confine[0]))
            continue
        try:
            reply = ("ok", fn(*request))
        except Exception as exc:
            reply = ("error", str(exc) if isinstance(exc, RewardError) else repr(exc))
        conn.send(reply)


def _answer(reply: Reply, limits: Limits) -> tuple[str, Any]:
    """A confined call's reply as the parent reads it: ok, error, memory or timeout."""
    if reply.status in ("ok", "error", "timeout"):
        return reply.status, reply.value
    if reply.status == "memory":
        return "memory", (
            f"ran out of memory: its process may take {limits.memory_mb} MiB of address "
            "space above what it started with; it was stopped (MemoryError)"
        )
    return "error", f"its process died: {reply.value}"


class _Child:
    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process, self.conn = process, conn

    def stop(self, graceful: bool) -> None:
        if graceful:
            with contextlib.suppress(OSError):  # the child may be gone already
                self.conn.send(None)
            self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)
        self.conn.close()


class TimeLimitedCall:
    """Calls of ``build(*args)``'s function in a child process, each at most
    ``timeout_s`` seconds (0: no limit, the child still isolates a crash).

    ``what`` names the function in messages. The child starts in the constructor (or on
    the first call, ``lazy``), which waits up to ``start_timeout_s`` for it to be ready,
    so a function that cannot be built (a missing package) fails there. Calls are
    serialised: one child runs one call at a time. A call past the limit raises
    :class:`CallTimeout` and kills the child; the next call waits for a new one. An
    exception in the function, or a child that died, raises :class:`CallError`.

    ``confine``: each call runs in a process forked from the child for it alone, confined
    to these limits (:mod:`staleflow.rewards.confinement`), and killed with everything it
    started at the limit; the child itself lives on. The function must then return plain
    data, which comes back as msgpack. ``confinement`` says what this machine allowed.
    """

    def __init__(
        self,
        build: Build,
        args: tuple[Any, ...],
        timeout_s: float,
        *,
        what: str,
        start_timeout_s: float = 120.0,
        lazy: bool = False,
        confine: Limits | None = None,
    ) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s={timeout_s}; it must be >= 0 seconds (0: no limit)")
        self.what = what
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.restarts = 0
        self.confine = confine
        self.confinement: tuple[str, ...] = ()
        self._build, self._args = build, args
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._finalizer: weakref.finalize | None = None
        if not lazy:
            with self._lock:
                self._start()

    def _start(self) -> _Child:
        parent, child_end = self._ctx.Pipe()
        process = self._ctx.Process(
            target=_serve,
            args=(
                child_end,
                self._build,
                self._args,
                None if self.confine is None else (self.confine, self.timeout_s),
            ),
            name=f"staleflow-sandbox({self.what})",
            daemon=True,  # dies with this process
        )
        process.start()
        child_end.close()
        child = _Child(process, parent)
        try:
            ready = parent.poll(self.start_timeout_s)
            status, text = parent.recv() if ready else ("fatal", "")
        except (EOFError, OSError):
            status, text = "fatal", f"the process exited with code {process.exitcode}"
        if status != "ready":
            child.stop(graceful=False)
            if not text:
                text = f"not ready after {self.start_timeout_s:g}s"
            if text.startswith(("ImportError", "ModuleNotFoundError")):
                raise ImportError(f"{self.what}: {text}")
            raise CallError(f"cannot start {self.what}: {text}")
        if self.confine is not None and text != self.confinement:
            self.confinement = tuple(text)
            logger.info("%s runs confined: %s", self.what, "; ".join(self.confinement))
            for note in self.confinement:
                if note.startswith("not confined"):
                    logger.warning("%s: %s", self.what, note)
        self._child = child
        self._finalizer = weakref.finalize(self, child.stop, True)
        return child

    def _discard(self) -> None:
        """Kill the current child (hung, or dead already); the next call starts another."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._child is not None:
            self._child.stop(graceful=False)
        self._child, self._finalizer = None, None
        self.restarts += 1

    def __call__(self, *request: object) -> Any:  # the child function's result, as is
        with self._lock:
            child = self._child or self._start()
            try:
                child.conn.send(request)
                # poll is also true when the child died: recv then raises EOFError. A
                # confined call's own limit is the child's to enforce; this one is its
                # backstop, for a child that hangs
                wait = self.timeout_s + _CONFINED_GRACE_S if self.confine else self.timeout_s
                if not child.conn.poll(wait or None):
                    self._discard()
                    logger.warning(
                        "%s took over %gs; killed its process", self.what, self.timeout_s
                    )
                    raise CallTimeout(f"timed out after {self.timeout_s:g}s")
                status, value = child.conn.recv()
            except (EOFError, OSError):
                self._discard()  # reaps it: its exit code is known only after that
                code = child.process.exitcode
                raise CallError(f"the {self.what} process died (exit code {code})") from None
        if status == "timeout":
            logger.warning("%s took over %gs; killed its process", self.what, self.timeout_s)
            raise CallTimeout(f"timed out after {self.timeout_s:g}s")
        if status == "memory":
            raise CallOutOfMemory(value)
        if status != "ok":
            raise CallError(value)
        return value

    def close(self) -> None:
        """Stop the child (also done when this object is collected, or at exit)."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._child, self._finalizer = None, None

    @property
    def pid(self) -> int | None:
        """The child's process id (None between a timeout and the next call)."""
        return None if self._child is None else self._child.process.pid


def _reward_fn(factory: str, options: Mapping[str, object]) -> Callable[[str, str], float]:
    fn = load_factory(factory)(**options)
    return lambda response_text, answer: as_reward(fn(response_text, answer))


class TimeLimitedRewardFn:
    """A :class:`~staleflow.rewards.base.RewardFn` whose calls take at most ``timeout_s``.

    factory, options: how the child builds the function (``"module:attr"`` called with
    ``options``; see :mod:`staleflow.rewards.registry`). The child starts in the
    constructor, which waits up to ``start_timeout_s`` for it to be ready, so a function
    that cannot be built (a missing package) fails here. Calls are serialised: one child
    scores one response at a time. A call past the limit raises
    :class:`~staleflow.rewards.base.RewardTimeout`; its next call waits for a new child.
    """

    def __init__(
        self,
        factory: str,
        timeout_s: float,
        *,
        options: Mapping[str, object] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}; it must be > 0 seconds")
        self.factory = factory
        try:
            self._call = TimeLimitedCall(
                _reward_fn,
                (factory, dict(options or {})),
                timeout_s,
                what=f"reward function {factory}",
                start_timeout_s=start_timeout_s,
            )
        except CallError as exc:
            raise RewardError(str(exc)) from None

    @property
    def timeout_s(self) -> float:
        return self._call.timeout_s

    @property
    def start_timeout_s(self) -> float:
        return self._call.start_timeout_s

    @property
    def restarts(self) -> int:
        return self._call.restarts

    @property
    def _child(self) -> _Child | None:
        return self._call._child

    def __call__(self, response_text: str, answer: str) -> float:
        try:
            return self._call(response_text, answer)
        except CallTimeout as exc:
            raise RewardTimeout(str(exc)) from None
        except CallError as exc:
            raise RewardError(str(exc)) from None

    def close(self) -> None:
        """Stop the child (also done when this object is collected, or at exit)."""
        self._call.close()

    @property
    def pid(self) -> int | None:
        """The child's process id (None between a timeout and the next call)."""
        return self._call.pid
