"""The held-out evaluation during training (``eval.every``), run from the driver on the
rollout engines (``docs/evaluation.md``).

When the control plane holds a step's record for its evaluation
(``staleflow.runtime.controller.eval_hold``), the driver starts a round: the first
``eval.problems`` problems of the held-out set, ``eval.samples`` responses each, spread
over the rollout instances in the run (every response of a problem on the same instance),
sent through their evaluation path (``staleflow.rollout.eval_lane``: no trajectories, so
neither the staleness manager, the coordinator, the trajectory server nor the audit ever
sees them). Each instance keeps at most ``eval.max_running`` of them in its engine at
once, beside its training trajectories, at the weights it holds. Finished responses are
scored by a reward worker with the run's reward function; the round's mean@k and pass@k
(``staleflow.rewards.estimators``) go back to the control plane, into that step's record.

An instance lost during a round takes its problems with it: the round reports the
problems it scored (``eval/problems``). The driver polls the round between its other
looks at the run (:meth:`EvalRounds.poll`), so nothing here blocks for long.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from staleflow.data.datasets import PromptDataset
from staleflow.rewards.estimators import EvalScores, score_problems
from staleflow.rollout.eval_lane import EVAL_ID_BASE, EvalOutput, EvalRequest
from staleflow.runtime.controller.clients import DriverControl
from staleflow.runtime.placement.ray_cluster import RayApi

logger = logging.getLogger(__name__)

# a round at the end of the run that gets no response for this long is given up
STALL_S = 300.0


class EvalRound:
    """The bookkeeping of one evaluation, without Ray: which request went where, what
    came back, what was scored. ``instances``: the instances in the run, in the order
    problems are dealt to them; ids are numbered from ``first_id``."""

    def __init__(
        self,
        step: int,
        heldout: PromptDataset,
        *,
        samples: int,
        k: int,
        instances: Sequence[int],
        first_id: int = EVAL_ID_BASE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not instances:
            raise ValueError("an evaluation needs at least one rollout instance")
        self.step, self.samples, self.k = step, samples, k
        self._clock = clock
        self.started = clock()
        self._answers = {p: heldout[p].answer for p in range(len(heldout))}
        self.requests: dict[int, list[EvalRequest]] = defaultdict(list)
        self._where: dict[int, tuple[int, int]] = {}  # eval id -> (instance, problem)
        next_id = first_id
        for p in range(len(heldout)):
            inst = instances[p % len(instances)]
            for _ in range(samples):
                self.requests[inst].append(EvalRequest(next_id, heldout[p].prompt_ids))
                self._where[next_id] = (inst, p)
                next_id += 1
        self.next_id = next_id
        self._rewards: dict[int, list[float]] = defaultdict(list)
        self._scoring: set[int] = set()  # ids sent to a reward worker, not yet back
        self._problem_of: dict[int, int] = {}  # the problem of each id being scored
        self._lost: set[int] = set()  # problems of an instance that was lost
        self._versions: list[int] = []
        self.last_progress = self.started

    def waiting_on(self) -> set[int]:
        """Instances with responses still to come."""
        return {i for i, _ in self._where.values()}

    def received(self, outputs: Sequence[EvalOutput]) -> list[tuple[int, np.ndarray, str]]:
        """Responses an instance finished: (id, tokens, ground truth) each, to score."""
        out = []
        for o in outputs:
            where = self._where.pop(o.eval_id, None)
            if where is None:
                continue  # not of this round (or its instance was already given up)
            problem = where[1]
            if len(o.versions):
                self._versions += [int(o.versions.min()), int(o.versions.max())]
            self._scoring.add(o.eval_id)
            self._problem_of[o.eval_id] = problem
            out.append((o.eval_id, o.tokens, self._answers[problem]))
        if out:
            self.last_progress = self._clock()
        return out

    def scored(self, ids: Sequence[int], rewards: Sequence[float]) -> None:
        for eval_id, reward in zip(ids, rewards, strict=True):
            if eval_id in self._scoring:
                self._scoring.discard(eval_id)
                self._rewards[self._problem_of.pop(eval_id)].append(float(reward))
        self.last_progress = self._clock()

    def lost(self, inst: int) -> None:
        """``inst`` left the run: its problems are not scored."""
        for eval_id, (i, p) in list(self._where.items()):
            if i == inst:
                del self._where[eval_id]
                self._lost.add(p)
        logger.warning(
            "evaluation of step %d: instance %d was lost with its problems", self.step, inst
        )

    @property
    def complete(self) -> bool:
        return not self._where and not self._scoring

    def scores(self) -> EvalScores | None:
        """The round's scores over the problems scored in full; None if there is none."""
        full = {
            p: r for p, r in self._rewards.items() if p not in self._lost and len(r) == self.samples
        }
        if not full:
            return None
        mean, passed = score_problems(full, self.k)
        return EvalScores(
            mean_at_k=mean,
            pass_at_k=passed,
            k=self.k,
            samples=self.samples,
            problems=len(full),
            version_min=min(self._versions),
            version_max=max(self._versions),
            seconds=self._clock() - self.started,
        )


class EvalRounds:
    """Runs :class:`EvalRound` over Ray for the control plane's due steps.

    ``control``: the run's client of the control actor; ``rewards``: the reward workers
    alive now (the supervisor may replace one)."""

    def __init__(
        self,
        ray: RayApi,
        control: DriverControl,
        rewards: Callable[[], Mapping[str, Any]],
        heldout: PromptDataset,
        *,
        samples: int,
        k: int,
        timeout_s: float = 60.0,
    ) -> None:
        self._ray, self._control, self._rewards = ray, control, rewards
        self._heldout, self._samples, self._k = heldout, samples, k
        self._timeout = timeout_s
        self._round: EvalRound | None = None
        self._handles: dict[int, Any] = {}
        self._scoring: list[tuple[Any, list[int], list[tuple[np.ndarray, str]]]] = []
        self._next_id = EVAL_ID_BASE
        self._next_worker = 0
        self._posted: int | None = None  # the step whose scores went to the plane last
        self.rounds = 0

    @property
    def running(self) -> bool:
        return self._round is not None

    def poll(self) -> None:
        """Start the due evaluation, or move the running one on; never waits long. An
        evaluation that fails is given up (its record goes out without it): it never
        stops the training."""
        if self._round is None:
            step = self._control.eval_due()
            if step is not None and step != self._posted:
                self._start(step)
            return
        try:
            self._advance(self._round)
        except Exception as exc:
            logger.warning("evaluation of step %d failed: %s", self._round.step, exc)
            self._end(self._round, failed=True)

    def pending(self) -> bool:
        """An evaluation runs, or a step waits for one."""
        if self._round is not None:
            return True
        step = self._control.eval_due()
        return step is not None and step != self._posted

    def finish(self, poll_s: float = 0.2, stall_s: float = STALL_S) -> None:
        """At the end of training: run the due and the running evaluation to their end
        (given up after ``stall_s`` without a response)."""
        while True:
            self.poll()
            if self._round is None and self._control.eval_due() is None:
                return  # the plane took the last scores: its records are out
            if self._round is not None and time.monotonic() - self._round.last_progress > stall_s:
                logger.warning(
                    "evaluation of step %d gave no response for %g s: given up",
                    self._round.step,
                    stall_s,
                )
                self._end(self._round, failed=True)
                continue
            time.sleep(poll_s)

    # -- one round -----------------------------------------------------------------------

    def _start(self, step: int) -> None:
        members = self._control.members(timeout_s=self._timeout)
        self._handles = {i: h for i, (_, h) in sorted(members.items())}
        if not self._handles:
            self._posted = step
            self._control.eval_done(step, None)
            return
        r = EvalRound(
            step,
            self._heldout,
            samples=self._samples,
            k=self._k,
            instances=list(self._handles),
            first_id=self._next_id,
        )
        self._next_id = r.next_id
        self._round = r
        refs = {i: self._handles[i].submit_eval.remote(reqs) for i, reqs in r.requests.items()}
        for inst, ref in refs.items():
            try:
                self._ray.get(ref, timeout=self._timeout)
            except Exception as exc:  # the instance is gone (the supervisor restarts it)
                logger.warning("evaluation of step %d: instance %d: %s", step, inst, exc)
                r.lost(inst)
        logger.info("evaluation of step %d started on %d instances", step, len(refs))

    def _advance(self, r: EvalRound) -> None:
        insts = sorted(r.waiting_on())
        refs = [self._handles[i].take_eval.remote() for i in insts]
        for inst, ref in zip(insts, refs, strict=True):
            try:
                outputs = self._ray.get(ref, timeout=self._timeout)
            except Exception as exc:
                logger.warning("evaluation of step %d: instance %d: %s", r.step, inst, exc)
                r.lost(inst)
                continue
            todo = r.received(outputs)
            if todo:
                self._score([t[0] for t in todo], [(t[1], t[2]) for t in todo])
        self._collect(r)
        if r.complete:
            self._end(r)

    def _score(self, ids: list[int], items: list[tuple[np.ndarray, str]]) -> None:
        workers = list(self._rewards().values())
        if not workers:
            raise RuntimeError("no reward worker is alive to score the evaluation")
        worker = workers[self._next_worker % len(workers)]
        self._next_worker += 1
        self._scoring.append((worker.score_eval.remote(items), ids, items))

    def _collect(self, r: EvalRound) -> None:
        if not self._scoring:
            return
        refs = [ref for ref, _, _ in self._scoring]
        done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        ready = set(done)
        left, retry = [], []
        for ref, ids, items in self._scoring:
            if ref not in ready:
                left.append((ref, ids, items))
                continue
            try:
                r.scored(ids, self._ray.get(ref))
            except self._ray.exceptions.RayActorError:  # that worker died: another scores
                retry.append((ids, items))
        self._scoring = left
        for ids, items in retry:
            self._score(ids, items)

    def _end(self, r: EvalRound, failed: bool = False) -> None:
        scores = None if failed else r.scores()
        self._round, self._scoring = None, []
        self.rounds += 1
        self._posted = r.step  # until the plane takes them, the step still looks due
        self._control.eval_done(r.step, scores)
        if scores is None:
            logger.warning("evaluation of step %d: nothing was scored", r.step)
        else:
            logger.info(
                "evaluation of step %d: mean@%d %.3f, pass@%d %.3f over %d problems (%.1f s)",
                r.step,
                scores.samples,
                scores.mean_at_k,
                scores.k,
                scores.pass_at_k,
                scores.problems,
                scores.seconds,
            )
