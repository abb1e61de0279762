"""The reward path of one finished trajectory: score it, store it in the TS as completed,
then tell the control plane (which Occupies its group). The TS write comes first so that
a buffer never turns Ready before the trainer can fetch every trajectory in it.

A trajectory that redundancy (§4.3) aborted while it was being scored is no longer in the
TS: that completion is a late message, dropped (and not reported), while the rest of the
batch goes through. So is one that was reassigned to another worker (this one was
thought lost) or scored twice: a stage with a ``worker_id`` names itself in its
completions and the TS refuses those (``docs/recovery.md``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from staleflow.control.late import CompletionSink, complete_live
from staleflow.envs.base import FINISH_ERROR
from staleflow.rollout.instance import Finished
from staleflow.runtime.interface import Rewarded
from trajectory_server.types import Completion, InfoValue, InstanceId, RewardTask, WorkerId

logger = logging.getLogger(__name__)


class ScoredLike(Protocol):
    @property
    def reward(self) -> float: ...

    @property
    def error(self) -> str: ...


class Scorer(Protocol):
    """Scores (response_text, answer) pairs; never raises for one bad item."""

    def __call__(self, items: Sequence[tuple[int, str, str]]) -> Sequence[ScoredLike]: ...


class RewardStage:
    def __init__(
        self,
        score: Scorer,
        decode: Callable[[np.ndarray], str],
        ts: CompletionSink,
        report: Callable[[Sequence[Rewarded]], None],
        worker_id: WorkerId | None = None,
    ) -> None:
        self._score, self._decode, self._ts, self._report = score, decode, ts, report
        self.worker_id = worker_id
        self.processed = 0
        self.errors = 0
        self.late = 0  # finished after redundancy had aborted them: dropped

    def process(
        self, finished: Sequence[Finished], instance_id: InstanceId | None = None
    ) -> list[int]:
        """Score and complete ``finished``; returns the ids the TS took (the rest were late).
        With ``instance_id`` each must still be ROUTED to that instance (a race copy
        completes in its holder's name, runtime/races.py)."""
        if not finished:
            return []
        tasks = [f.task for f in finished]
        results = self._scored([(t.traj_id, t.tokens, t.answer) for t in tasks])
        return self.complete(finished, results, instance_id)

    def score(self, responses: Sequence[tuple[np.ndarray, str]]) -> list[float]:
        """The rewards of responses (tokens, ground truth) that are no trajectories (the
        held-out evaluation): decoded and scored as a trajectory is, stored and reported
        nowhere; a response the function could not score gets 0.0, as in training."""
        results = self._scored(
            [(i, tokens, answer) for i, (tokens, answer) in enumerate(responses)]
        )
        return [r.reward for r in results]

    def _scored(self, items: Sequence[tuple[int, np.ndarray, str]]) -> Sequence[ScoredLike]:
        texts = []
        for traj_id, tokens, answer in items:
            try:
                text = self._decode(tokens)
            except Exception as exc:  # a bad token must not stop the pool
                text = ""
                logger.warning("response %d: cannot be decoded: %s", traj_id, exc)
            texts.append((traj_id, text, answer))
        results = self._score(texts)
        if len(results) != len(items):
            raise RuntimeError(
                f"the reward function scored {len(results)} of {len(items)} responses"
            )
        return results

    def complete(
        self,
        finished: Sequence[Finished],
        results: Sequence[ScoredLike],
        instance_id: InstanceId | None = None,
        infos: Sequence[Mapping[str, InfoValue]] | None = None,
        finish_reasons: Sequence[str] | None = None,
    ) -> list[int]:
        """Store scored trajectories in the TS as completed, then report them; returns the
        ids the TS took. ``infos`` and ``finish_reasons`` (one per trajectory) add to the
        record and replace the engine's reason (an episode's end, e.g. ``max_turns``)."""
        infos = infos or [{}] * len(finished)
        reasons = finish_reasons or [f.task.finish_reason for f in finished]
        completions = []
        for f, r, extra, reason in zip(finished, results, infos, reasons, strict=True):
            info: dict[str, int | float | str] = {"instance": f.instance, **extra}
            if r.error:
                info["reward_error"] = r.error[:500]
                self.errors += 1
            t = f.task
            completions.append(
                Completion(
                    t.traj_id, t.tokens, t.logprobs, t.versions, r.reward, reason, info, t.mask
                )
            )
        stored = {
            c.traj_id
            for c in complete_live(
                self._ts, completions, worker_id=self.worker_id, instance_id=instance_id
            )
        }
        self.processed += len(finished)
        self.late += len(finished) - len(stored)
        rewarded = [
            Rewarded(
                traj_id=f.task.traj_id,
                group_id=f.task.group_id,
                v_traj=f.task.v_traj,
                reward=r.reward,
                error=r.error,
                response_len=len(f.task.tokens),
                finish_reason=reason,
                instance=f.instance,
                turns=int(extra.get("turns", 0)),
                tool_calls=int(extra.get("tool_calls", 0)),
                env_errors=int(extra.get("env_errors", 0)) + (reason == FINISH_ERROR),
                tool_wait_s=float(extra.get("tool_latency_s", 0.0)),
            )
            for f, r, reason, extra in zip(finished, results, reasons, infos, strict=True)
            if f.task.traj_id in stored
        ]
        if rewarded:
            self._report(rewarded)
        return [r.traj_id for r in rewarded]


def finished_from_task(t: RewardTask) -> Finished:
    """A REWARDING trajectory the TS hands a worker again (its worker was lost, or the run
    resumed), as the worker receives a finished one: a multi-turn trajectory's
    environment state stays in the TS, where the environment stage reads it."""
    return Finished(t, -1)  # its instance is unknown (and may be gone)
