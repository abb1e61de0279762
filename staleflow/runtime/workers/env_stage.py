"""The environment step of a multi-turn trajectory, on a reward worker, off the instance.

A model turn ends at its end-of-turn stop; the instance hands the trajectory to a reward
worker as it hands a finished single-turn response (the TS records it REWARDING with
that worker), so it holds no decode slot and is in no Pull's way while its tool runs.
Here its environment steps (``staleflow.envs``): the state comes from the TS (none yet:
the episode starts from the sample the group carries, seeded by the trajectory id), the
step's observation is tokenised and appended with mask False, logprob 0 and the version
of the model token before it, and the trajectory goes back to the TS queued for its next
turn (``next_turn``) with its ``V_traj``, so the staleness bound covers every turn.
When the episode ends (:func:`staleflow.envs.after_step`: the environment ended it, or
the last turn, or the token limit) the environment scores it and it completes as a
single-turn response does.

What can go wrong is one trajectory's: a step that raises, runs past its limit
(``env.step_timeout_s``: abandoned on its thread, or with ``env.sandbox`` killed with
every process it started, :mod:`staleflow.runtime.workers.env_sandbox`), runs out of its
sandbox's memory, returns a state that is not plain data, or an observation the
tokenizer cannot encode ends that episode with
``env_error`` (scored 0, the reason in the record); a malformed tool call is the
environment's to answer (the calculator answers ``error`` and goes on). A turn the engine
cut at the token budget (``length``) ends the episode without a step, in every mode.

A lost worker costs the steps it was running: its trajectories are REWARDING in the TS
with the state before the step, and the worker that takes them over runs the step again
(the environment is a function of the state and the seed, so it answers the same and
waits as long; a tool with side effects would run twice).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

import msgpack
import numpy as np

from staleflow.control.late import next_turn_live
from staleflow.engines.base import FINISH_LENGTH
from staleflow.envs.base import (
    FINISH_ERROR,
    FINISH_MAX_TOKENS,
    EnvContractError,
    Environment,
    EnvSample,
    EnvState,
    EpisodeLimits,
    ModelTurn,
    after_step,
    check_plain,
)
from staleflow.envs.formats import TurnFormat
from staleflow.rollout.instance import Finished
from staleflow.runtime.workers.env_sandbox import SandboxedSteps, StepFailed, StepTimeout
from staleflow.runtime.workers.reward_stage import RewardStage
from trajectory_server.types import InfoValue, InstanceId, NextTurn, RewardTask

logger = logging.getLogger(__name__)


class EnvServer(Protocol):
    """The part of the TS the environment stage uses (besides the reward stage's)."""

    def env_states(self, traj_ids: Sequence[int]) -> dict[int, bytes]: ...

    def next_turn(self, turns: Sequence[NextTurn], *, worker_id: str | int) -> None: ...


@dataclass(frozen=True, slots=True)
class _Scored:
    reward: float
    error: str


@dataclass(frozen=True, slots=True)
class _Outcome:
    """One trajectory after its step: ``next`` to queue it again, else its end."""

    next: NextTurn | None
    reward: float = 0.0
    finish: str = ""
    error: str = ""
    info: Mapping[str, InfoValue] | None = None


def _tally(into: dict[str, InfoValue], step: Mapping[str, InfoValue]) -> None:
    """Numbers add up over the episode's steps; text keeps the last value."""
    for key, value in step.items():
        old = into.get(key)
        if isinstance(value, int | float) and isinstance(old, int | float):
            into[key] = old + value
        else:
            into[key] = value


def turns_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of the model turns in a response's loss mask."""
    m = np.concatenate([[False], np.asarray(mask, dtype=np.bool_), [False]])
    edges = np.flatnonzero(m[1:] != m[:-1])
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


class EnvironmentStage:
    """Runs environment steps for finished model turns; see the module docstring.

    ``rewards``: the reward stage that completes ended episodes (its scorer is unused).
    ``threads``: steps of one batch run at once, so their tools wait side by side.
    """

    def __init__(
        self,
        env: Environment,
        fmt: TurnFormat,
        limits: EpisodeLimits,
        ts: EnvServer,
        rewards: RewardStage,
        *,
        worker_id: str | int,
        threads: int = 8,
        step_timeout_s: float = 0.0,
        sandbox: SandboxedSteps | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._env, self._fmt, self._limits = env, fmt, limits
        self._ts, self._rewards, self._worker = ts, rewards, worker_id
        self._sleep = sleep
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="env-step")
        # with a limit, each step runs on a thread of its own that the stage stops waiting
        # for (Python cannot kill a thread: a step past its limit runs on, abandoned)
        # ``sandbox`` (env.sandbox): each step runs in a child process, killed past its
        # limit, instead
        self._timeout_s = step_timeout_s
        self._sandbox = sandbox
        self._steps_pool = (
            ThreadPoolExecutor(max(1, threads), thread_name_prefix="env-step-limited")
            if step_timeout_s > 0 and sandbox is None
            else None
        )
        self.steps = 0
        self.errors = 0
        self.continued = 0
        self.wait_s = 0.0  # tool latency slept, summed over steps

    def process(
        self, finished: Sequence[Finished], instance_id: InstanceId | None = None
    ) -> list[int]:
        """Step every trajectory of ``finished``; queue each continuing one and complete
        each ended one as soon as its own step returns. Returns the ids completed.

        One trajectory's slow tool holds back none of the batch: a turn that came back
        fast takes its next turn (or completes) while its neighbours still wait, so a
        batch costs the wall time of its slowest tool once, not every trajectory."""
        if not finished:
            return []
        states = self._ts.env_states([f.task.traj_id for f in finished])
        futures = {
            self._pool.submit(self._one, f.task, states.get(f.task.traj_id, b"")): f
            for f in finished
        }
        completed: list[int] = []
        for future in as_completed(futures):
            f, o = futures[future], future.result()
            if o.next is not None:
                going = len(next_turn_live(self._ts, [o.next], self._worker))
                with self._lock:
                    self.continued += going
                continue
            completed += self._rewards.complete(
                [f],
                [_Scored(o.reward, o.error)],
                instance_id,
                infos=[dict(o.info or {})],
                finish_reasons=[o.finish],
            )
        return completed

    def _one(self, t: RewardTask, packed: bytes) -> _Outcome:
        try:
            return self._step(t, packed)
        except Exception as exc:  # one trajectory's failure, never the worker's
            with self._lock:
                self.errors += 1
            logger.warning("trajectory %d: its environment failed: %r", t.traj_id, exc)
            why = str(exc) if isinstance(exc, StepTimeout | StepFailed) else repr(exc)
            return _Outcome(None, 0.0, FINISH_ERROR, f"environment: {why}"[:500])

    def _step(self, t: RewardTask, packed: bytes) -> _Outcome:
        mask = np.asarray(t.mask, dtype=np.bool_)
        spans = turns_of(mask)
        if packed:
            # what the TS keeps: the environment's state and this stage's running tally of
            # the episode (summed step counters, the last error), for the final record
            envelope = msgpack.unpackb(packed)
            state, info = envelope["state"], envelope["info"]
        else:
            state = self._env.start(EnvSample.from_json(t.answer), seed=t.traj_id).state
            info = {}
        turns = len(spans)
        info["turns"] = turns
        if t.finish_reason == FINISH_LENGTH or not spans:  # cut mid-turn: no step, in every mode
            return _Outcome(None, self._score(state), FINISH_MAX_TOKENS, info=info)
        start, end = spans[-1]
        ids = t.tokens[start:end]
        turn = ModelTurn(turns - 1, self._fmt.turn_text(ids), ids)
        if self._sandbox is not None:
            step = self._sandbox(state, turn)
        elif self._steps_pool is None:
            step = self._env.step(state, turn)
        else:
            try:
                step = self._steps_pool.submit(self._env.step, state, turn).result(self._timeout_s)
            except FutureTimeout:
                raise StepTimeout(
                    f"the environment's step took over {self._timeout_s:g} s (env.step_timeout_s)"
                ) from None
        check_plain(step.state)
        if step.latency_s > 0:
            self._sleep(step.latency_s)
        with self._lock:
            self.steps += 1
            self.wait_s += step.latency_s
        _tally(info, step.info)
        obs = np.zeros(0, np.int32) if step.done else self._fmt.observation_ids(step.observation)
        verdict = after_step(
            self._limits,
            turns_done=turns,
            response_tokens=len(t.tokens),
            step=step,
            observation_ids=obs,
        )
        if step.error:
            info["env_error"] = step.error[:500]
            info["env_errors"] = int(info.get("env_errors", 0)) + 1
            logger.info("trajectory %d: %s", t.traj_id, step.error)
        if verdict.ended:
            return _Outcome(None, self._score(step.state), verdict.finish, info=info)
        n = len(verdict.observation_ids)
        if n == 0:  # the mask could not tell this turn from the next
            raise EnvContractError(
                "the turn format rendered the observation as no tokens; an observation "
                "needs at least one (e.g. the format's tool-response markup)"
            )
        last_version = int(t.versions[-1]) if len(t.versions) else 0
        return _Outcome(
            NextTurn(
                t.traj_id,
                np.concatenate([t.tokens, verdict.observation_ids]).astype(np.int32),
                np.concatenate([t.logprobs, np.zeros(n, np.float32)]),
                np.concatenate([t.versions, np.full(n, last_version, np.int32)]),
                np.concatenate([mask, np.zeros(n, np.bool_)]),
                msgpack.packb({"state": step.state, "info": info}),
            )
        )

    def _score(self, state: EnvState) -> float:
        return float(self._env.score(state))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        if self._steps_pool is not None:
            self._steps_pool.shutdown(wait=False)
        if self._sandbox is not None:
            self._sandbox.close()
