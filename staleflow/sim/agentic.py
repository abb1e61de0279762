"""Simulated agentic (multi-turn, tool-using) work: what each trajectory will do.

A trajectory is its prompt, then model turns separated by tool calls: turn ``k`` decodes
``turn_tokens[k]`` tokens, ends with a tool call whose answer (``obs_tokens[k]``
observation tokens, prefilled, never decoded) arrives after ``latency[k]`` seconds, and
the next turn starts from there. The last turn ends the episode (its answer is scored).
:class:`AgenticWorkload` draws every trajectory's :class:`TurnPlan` when its group is
sampled, from the run's seed only, so every system of a comparison meets the same turns,
tokens and tool latencies.

The engine never sees a plan: the planes end each route at the current turn's end
(:meth:`AgenticWorkload.turn_end`) and the cluster's environments
(``staleflow.sim.env``) wait the turn's latency and append its observation.

Where the numbers of the presets come from: ``docs/simulator_agentic.md``.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from staleflow.sim.workload import SimSample, WorkloadConfig, _Source


@dataclass(frozen=True, slots=True)
class AgenticConfig:
    """How agentic trajectories are drawn (tokens, seconds).

    Turns: a group's median number of model turns is ``turns_median x exp(N(0,
    group_turns_sigma))`` (one task is hard for every attempt), each member's
    ``that x exp(N(0, turns_sigma))``, rounded and clipped to ``[1, max_turns]``.
    Tokens: each model turn decodes ``lognormal(turn_tokens_median, turn_tokens_sigma)``
    tokens (at most ``max_turn_tokens``); each tool answer is ``lognormal(obs_tokens_median,
    obs_tokens_sigma)`` tokens (at most ``max_obs_tokens``, the tool's output truncation).
    The episode also ends once its context (prompt and response) would pass
    ``max_context``: a turn is cut to fit, and an observation that leaves fewer than
    ``min_turn_room`` tokens is not appended (the turn before it is the last), the
    environments' ``max_tokens`` rule (``staleflow.envs.after_step``).
    Tool latency: ``lognormal(latency_median_s, latency_sigma)``; an attempt that reaches
    ``latency_timeout_s`` is cut there and fails; any attempt also fails with
    ``fail_prob``; a failed call is retried up to ``max_retries`` times (each retry a new
    draw), then its error is the observation. The wait is the sum of the attempts.
    Prompts: ``lognormal(prompt_median, prompt_sigma)``, at most ``max_prompt``.
    """

    turns_median: float = 4.0
    turns_sigma: float = 0.4
    group_turns_sigma: float = 0.4
    max_turns: int = 8
    turn_tokens_median: float = 300.0
    turn_tokens_sigma: float = 0.6
    max_turn_tokens: int = 2048
    obs_tokens_median: float = 400.0
    obs_tokens_sigma: float = 0.5
    max_obs_tokens: int = 2048
    max_context: int = 32_768
    min_turn_room: int = 64
    latency_median_s: float = 1.0
    latency_sigma: float = 1.0
    latency_timeout_s: float = 60.0
    fail_prob: float = 0.0
    max_retries: int = 0
    prompt_median: float = 300.0
    prompt_sigma: float = 0.5
    max_prompt: int = 4096

    def __post_init__(self) -> None:
        ints = ("max_turns", "max_turn_tokens", "max_obs_tokens", "max_context", "max_prompt")
        for name in ints:
            if getattr(self, name) < 1:
                raise ValueError(f"AgenticConfig.{name}={getattr(self, name)}: use >= 1")
        for name in ("turns_median", "turn_tokens_median", "obs_tokens_median", "prompt_median"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"AgenticConfig.{name}={getattr(self, name)}: use >= 1")
        sigmas = (
            "turns_sigma",
            "group_turns_sigma",
            "turn_tokens_sigma",
            "obs_tokens_sigma",
            "latency_sigma",
            "prompt_sigma",
        )
        for name in sigmas:
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"AgenticConfig.{name}={getattr(self, name)}: use >= 0")
        if not self.latency_median_s > 0.0 or not self.latency_timeout_s > 0.0:
            raise ValueError("AgenticConfig: tool latencies must be > 0 seconds")
        if not 0.0 <= self.fail_prob < 1.0:
            raise ValueError(f"AgenticConfig.fail_prob={self.fail_prob}: use [0, 1)")
        if self.max_retries < 0 or self.min_turn_room < 1:
            raise ValueError("AgenticConfig: max_retries >= 0 and min_turn_room >= 1")
        if self.max_prompt + self.min_turn_room > self.max_context:
            raise ValueError(
                f"AgenticConfig: max_prompt ({self.max_prompt}) leaves no room for a turn "
                f"within max_context ({self.max_context})"
            )

    @property
    def max_response(self) -> int:
        """The longest response a trajectory can have (the whole context but its prompt)."""
        return self.max_context - 1

    def as_workload(self) -> WorkloadConfig:
        """The single-turn workload config the rest of the simulator reads (its cap)."""
        return WorkloadConfig(
            max_response=self.max_response,
            prompt_median=min(self.prompt_median, float(self.max_prompt)),
            prompt_sigma=self.prompt_sigma,
            max_prompt=self.max_prompt,
        )


@dataclass(frozen=True, slots=True)
class TurnPlan:
    """One trajectory's turns. ``ends[k]``: the response length (tokens after the prompt,
    observations included) at which model turn ``k`` ends; ``obs[k]``, ``latency[k]``,
    ``attempts[k]``: the tool call after turn ``k`` (none after the last turn)."""

    ends: tuple[int, ...]
    obs: tuple[int, ...]
    latency: tuple[float, ...]
    attempts: tuple[int, ...]

    @property
    def turns(self) -> int:
        return len(self.ends)

    @property
    def total(self) -> int:
        return self.ends[-1]

    def turn_end(self, response_len: int) -> int:
        """The end of the turn a response of ``response_len`` tokens is in (or starts)."""
        k = bisect_right(self.ends, response_len)
        return self.ends[min(k, len(self.ends) - 1)]

    def call_after(self, response_len: int) -> int | None:
        """Index of the tool call made at ``response_len`` (a turn's end), None when the
        response is not at the end of a turn that a call follows."""
        k = bisect_right(self.ends, response_len) - 1
        if k < 0 or k >= len(self.obs) or self.ends[k] != response_len:
            return None
        return k


def draw_plan(c: AgenticConfig, rng: np.random.Generator, prompt: int, median: float) -> TurnPlan:
    """One trajectory's plan (see :class:`AgenticConfig`); ``median``: its group's median
    number of turns."""
    turns = int(
        np.clip(round(median * math.exp(c.turns_sigma * rng.standard_normal())), 1, c.max_turns)
    )
    tokens = np.minimum(
        np.rint(
            np.exp(np.log(c.turn_tokens_median) + c.turn_tokens_sigma * rng.standard_normal(turns))
        ),
        c.max_turn_tokens,
    ).astype(np.int64)
    obs = np.minimum(
        np.rint(
            np.exp(np.log(c.obs_tokens_median) + c.obs_tokens_sigma * rng.standard_normal(turns))
        ),
        c.max_obs_tokens,
    ).astype(np.int64)
    room = c.max_context - prompt  # response tokens the context still holds
    ends: list[int] = []
    obs_out: list[int] = []
    used = 0
    for k in range(turns):
        turn = max(1, min(int(tokens[k]), room - used))
        used += turn
        ends.append(used)
        if k == turns - 1 or room - used - int(obs[k]) < c.min_turn_room:
            break  # the last turn, or its observation would leave no room for another
        obs_out.append(max(1, int(obs[k])))
        used += obs_out[-1]
    latency, attempts = [], []
    for _ in obs_out:
        wait, tries = 0.0, 0
        while True:
            tries += 1
            draw = c.latency_median_s * math.exp(c.latency_sigma * rng.standard_normal())
            failed = draw >= c.latency_timeout_s or rng.random() < c.fail_prob
            wait += min(draw, c.latency_timeout_s)
            if not failed or tries > c.max_retries:
                break
        latency.append(wait)
        attempts.append(tries)
    return TurnPlan(tuple(ends), tuple(obs_out), tuple(latency), tuple(attempts))


class AgenticWorkload(_Source):
    """Endless prompts whose trajectories follow drawn :class:`TurnPlan` s."""

    def __init__(self, config: AgenticConfig, members: int, seed: int = 0) -> None:
        super().__init__(members)
        self.config = config
        self._rng = np.random.default_rng([seed, 0xA6E])
        self._next_id = 0
        self._plans: dict[int, tuple[TurnPlan, ...]] = {}  # sample -> its members' plans
        self._plan_of: dict[int, TurnPlan] = {}  # trajectory -> its plan

    def next_sample(self) -> SimSample:
        c, rng = self.config, self._rng
        prompt = int(
            np.clip(
                round(rng.lognormal(math.log(c.prompt_median), c.prompt_sigma)), 1, c.max_prompt
            )
        )
        median = c.turns_median * math.exp(c.group_turns_sigma * rng.standard_normal())
        plans = tuple(draw_plan(c, rng, prompt, median) for _ in range(self.members))
        sid = self._next_id
        self._next_id += 1
        self._plans[sid] = plans
        ids = np.zeros(prompt, dtype=np.int32)
        return self._remember(SimSample(sid, ids, "", tuple(p.total for p in plans)))

    def plan(self, sample_id: int, traj_id: int) -> TurnPlan:
        """The plan of trajectory ``traj_id``: members take their group's plans in the
        order they are first asked for, deterministic for a deterministic run."""
        known = self._plan_of.get(traj_id)
        if known is not None:
            return known
        plans = self._plans[sample_id]
        k = self._next_member.get(sample_id, 0)
        self._next_member[sample_id] = k + 1
        plan = plans[k % len(plans)]
        self._plan_of[traj_id] = plan
        self._assigned[traj_id] = plan.total
        return plan

    def response_length(self, sample_id: int, traj_id: int) -> int:
        return self.plan(sample_id, traj_id).total

    def turn_end(self, sample_id: int, traj_id: int, response_len: int) -> int:
        """Where the current route of a trajectory with ``response_len`` tokens stops:
        the end of its current model turn."""
        return self.plan(sample_id, traj_id).turn_end(response_len)

    def forget(self, traj_id: int) -> None:
        super().forget(traj_id)
        self._plan_of.pop(traj_id, None)
