"""Environment steps in killable child processes (``env.sandbox=true``).

An environment step can run code the model wrote (a code tool), which may loop forever.
In the reward worker's own process a step past ``env.step_timeout_s`` can only be
abandoned: Python cannot kill a thread, so it runs on, holding a core. Here each step
runs in a child process of the reward sandbox (:class:`~staleflow.rewards.sandbox.TimeLimitedCall`),
which builds the environment itself from its ``module:attribute`` target, and a step past
the limit is **killed** with its process; the next step gets a fresh one. One child runs
one step at a time, so there are as many children as steps run at once (``env.threads``),
each started when first needed.

What crosses to the child is the state (plain data) and the turn; what comes back is the
:class:`~staleflow.envs.Step`. ``start`` and ``score`` stay in the worker's process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from staleflow.envs import EnvState, ModelTurn, Step, make_environment
from staleflow.rewards.sandbox import CallError, CallTimeout, TimeLimitedCall

logger = logging.getLogger(__name__)


class StepTimeout(RuntimeError):
    """An environment step ran past ``env.step_timeout_s``."""


class StepFailed(RuntimeError):
    """An environment step raised in its child process, or the process died; the message
    says which."""


def _env_step(target: str, options: Mapping[str, object]) -> Callable[[EnvState, ModelTurn], Step]:
    """In the child: the environment's ``step``, the environment built as the worker
    builds it."""
    return make_environment(target, **options).step


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
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(
                f"env.step_timeout_s={timeout_s}: a sandboxed step needs a limit (> 0 s) "
                "past which its process is killed"
            )
        self.target, self.timeout_s = target, float(timeout_s)
        self._options = dict(options)
        self._start_timeout_s = start_timeout_s
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
        )
        with self._lock:
            self._all.append(child)
        return child

    def __call__(self, state: EnvState, turn: ModelTurn) -> Step:
        with self._slots:
            child = self._take()
            try:
                step = child(state, turn)
            except CallTimeout:
                raise StepTimeout(
                    f"the environment's step took over {self.timeout_s:g} s "
                    "(env.step_timeout_s); its process was killed (env.sandbox)"
                ) from None
            except CallError as exc:
                raise StepFailed(f"in its sandbox process: {exc}") from None
            finally:
                with self._lock:
                    self._idle.append(child)
        if not isinstance(step, Step):
            raise StepFailed(f"step returned a {type(step).__name__}, not a Step")
        return step

    @property
    def restarts(self) -> int:
        """Children killed (past the limit) or found dead, over all slots."""
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
