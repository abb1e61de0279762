"""Environment steps in confined, killable processes (``env.sandbox=true``).

An environment step can run code the model wrote (a code tool), which may loop forever,
fork, fill the memory or the disk, or reach the network. In the reward worker's own
process a step past ``env.step_timeout_s`` can only be abandoned: Python cannot kill a
thread. Here each step runs through the reward sandbox
(:class:`~staleflow.rewards.sandbox.TimeLimitedCall`): a child process builds the
environment itself from its ``module:attribute`` target, once, and runs every step in a
process forked from it for that step alone, confined
(:mod:`staleflow.rewards.confinement`: limits, no network, a read-only file system but
an empty working directory, a scrubbed environment, where this kernel allows each) and
killed with every process it started past the limit. One child runs one step at a time,
so there are as many children as steps run at once (``env.threads``), each started when
first needed.

What crosses to the step is the state (plain data) and the turn; what comes back is the
:class:`~staleflow.envs.Step` as plain data (msgpack, never pickled: it was made by
untrusted code), rebuilt and checked here. ``start`` and ``score`` stay in the worker's
process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from staleflow.envs import EnvState, ModelTurn, Step, make_environment
from staleflow.rewards.confinement import Limits
from staleflow.rewards.sandbox import CallError, CallOutOfMemory, CallTimeout, TimeLimitedCall

logger = logging.getLogger(__name__)


class StepTimeout(RuntimeError):
    """An environment step ran past ``env.step_timeout_s``."""


class StepFailed(RuntimeError):
    """An environment step raised in its child process, or the process died; the message
    says which."""


def _env_step(
    target: str, options: Mapping[str, object]
) -> Callable[[EnvState, ModelTurn], dict[str, object]]:
    """In the child: the environment's ``step``, the environment built as the worker
    builds it, answering plain data."""
    step = make_environment(target, **options).step

    def plain_step(state: EnvState, turn: ModelTurn) -> dict[str, object]:
        answer = step(state, turn)
        if not isinstance(answer, Step):
            raise TypeError(f"step returned a {type(answer).__name__}, not a Step")
        return {f: getattr(answer, f) for f in _STEP_FIELDS}

    return plain_step


_STEP_FIELDS = ("state", "observation", "done", "latency_s", "error", "info")
_STEP_TYPES = (None, str, bool, (int, float), str, dict)


def _as_step(plain: object) -> Step:
    """The step's answer rebuilt, each field of the type a Step holds."""
    if not isinstance(plain, dict) or set(plain) != set(_STEP_FIELDS):
        raise StepFailed(f"its sandbox answered {type(plain).__name__}, not a Step's fields")
    for name, kind in zip(_STEP_FIELDS, _STEP_TYPES, strict=True):
        if kind is not None and not isinstance(plain[name], kind):
            raise StepFailed(f"its Step.{name} is a {type(plain[name]).__name__}")
    return Step(**plain)


class SandboxedSteps:
    """``step(state, turn)`` of the environment ``target`` (``"module:attribute"``, built
    with ``options``), each call in a child process killed past ``timeout_s``; up to
    ``processes`` calls at once, each on a child of its own."""

    def __init__(
        self,
        target: str,
        options: Mapping[str, object],
        timeout_s: float,
        processes: int,
        *,
        start_timeout_s: float = 120.0,
        limits: Limits | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(
                f"env.step_timeout_s={timeout_s}: a sandboxed step needs a limit (> 0 s) "
                "past which its process is killed"
            )
        self.target, self.timeout_s = target, float(timeout_s)
        self._options = dict(options)
        self._start_timeout_s = start_timeout_s
        # CPU seconds: the wall-clock limit is the binding one; this one is for children
        # the step leaves behind it in a process group it escaped
        self.limits = limits or Limits(cpu_s=self.timeout_s)
        self._slots = threading.BoundedSemaphore(max(1, processes))
        self._lock = threading.Lock()
        self._idle: list[TimeLimitedCall] = []
        self._all: list[TimeLimitedCall] = []

    def _take(self) -> TimeLimitedCall:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        child = TimeLimitedCall(
            _env_step,
            (self.target, self._options),
            self.timeout_s,
            what=f"environment step {self.target}",
            start_timeout_s=self._start_timeout_s,
            lazy=True,  # started by its first call, on the stage's thread
            confine=self.limits,
        )
        with self._lock:
            self._all.append(child)
        return child

    def __call__(self, state: EnvState, turn: ModelTurn) -> Step:
        with self._slots:
            child = self._take()
            try:
                plain = child(state, turn)
            except CallTimeout:
                raise StepTimeout(
                    f"the environment's step took over {self.timeout_s:g} s "
                    "(env.step_timeout_s); its process was killed, with every process "
                    "it started (env.sandbox)"
                ) from None
            except CallOutOfMemory as exc:
                raise StepFailed(f"{exc} (env.sandbox_memory_mb)") from None
            except CallError as exc:
                raise StepFailed(f"in its sandbox process: {exc}") from None
            finally:
                with self._lock:
                    self._idle.append(child)
        return _as_step(plain)

    @property
    def confinement(self) -> tuple[str, ...]:
        """What the steps' confinement holds on this machine, and why any part does not
        (empty until a child started)."""
        with self._lock:
            return next((c.confinement for c in self._all if c.confinement), ())

    @property
    def restarts(self) -> int:
        """Children that hung past the limit's backstop or died, over all slots (a step
        past the limit kills the step's process, not the child)."""
        with self._lock:
            return sum(c.restarts for c in self._all)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [c.pid for c in self._all if c.pid is not None]

    def close(self) -> None:
        with self._lock:
            children, self._all, self._idle = self._all, [], []
        for child in children:
            child.close()
