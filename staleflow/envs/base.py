"""The environment contract: what a multi-turn, tool-using task gives a trajectory.

An :class:`Environment` is the *rules* of one kind of task, built once per worker from
its options and holding nothing about any trajectory. Everything one trajectory's
environment knows is its :data:`EnvState`: plain data (None, bool, int, float, str, and
lists and str-keyed dicts of those) that msgpack packs as it is. So an environment made
for a trajectory is ``(rules, state)``, the state travels with the trajectory (in the TS,
in its checkpoints) and never lives on a rollout instance or a worker: after a
migration, a lost worker or a resume the next step runs from the state the TS holds.

One trajectory's life (``docs/agentic.md``)::

    episode = env.start(sample, seed)        # initial messages, tool schemas, state
    ...the model generates one turn, ending at its end-of-turn stop...
    step = env.step(episode.state, turn)     # observation text, done, new state
    ...the observation's tokens are appended (loss mask False); the next turn...
    reward = env.score(step.state)           # once the episode ended

Every method is a function of its arguments (no hidden state, no clock, no global
random), so re-running a step from the stored state after a failure gives the same
observation: draw any randomness from ``seed`` (:func:`keyed_uniform`).

The episode's limits (:class:`EpisodeLimits`: most turns, most tokens) are enforced by
:func:`after_step` outside the environment, the same way in every mode.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Plain data: what msgpack packs without an extension, and json without a default.
Plain = None | bool | int | float | str | list["Plain"] | dict[str, "Plain"]
EnvState = dict[str, Plain]
Message = Mapping[str, str]  # {"role": ..., "content": ...}
ToolSchema = Mapping[str, Any]  # an OpenAI-style {"type": "function", "function": {...}}

# How an episode ended (``Step.finish`` and :func:`after_step`).
FINISH_DONE = "done"  # the environment ended it (e.g. a final answer)
FINISH_MAX_TURNS = "max_turns"  # the model used its last turn
FINISH_MAX_TOKENS = "max_tokens"  # the next observation would pass the token limit
FINISH_ERROR = "env_error"  # the environment raised, or broke its contract
# the finish reasons of a response cut by a limit: a single-turn response by its token
# budget ("length", as engines say), an episode by either of its limits
TRUNCATIONS = frozenset({"length", FINISH_MAX_TOKENS, FINISH_MAX_TURNS})


class EnvContractError(RuntimeError):
    """An environment broke its contract (state that is not plain data, a bad step)."""


@dataclass(frozen=True, slots=True)
class EnvSample:
    """The dataset row an episode starts from: its prompt text and ground truth, and any
    extra fields the task's rows carry."""

    sample_id: int
    prompt: str
    answer: str
    extra: Mapping[str, Plain] = field(default_factory=dict)

    def to_json(self) -> str:
        """The sample as one JSON string: what the TS carries as a group's ground truth
        for an environment task, so the worker that starts the episode needs no dataset."""
        body = {"id": self.sample_id, "prompt": self.prompt, "answer": self.answer}
        if self.extra:
            body["extra"] = dict(self.extra)
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EnvSample:
        try:
            body = json.loads(text)
            return cls(
                int(body["id"]), str(body["prompt"]), str(body["answer"]), body.get("extra", {})
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise EnvContractError(
                f"not an environment sample ({exc!r}): {text[:80]!r}; environment tasks carry "
                "EnvSample.to_json() as the ground truth (data.task must name the environment)"
            ) from None


@dataclass(frozen=True, slots=True)
class Episode:
    """What :meth:`Environment.start` gives one trajectory: the messages the model sees
    first, the tools it may call (also named in the messages, where the task's format
    puts them), and the environment's state."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSchema, ...]
    state: EnvState


@dataclass(frozen=True, slots=True, eq=False)
class ModelTurn:
    """One model turn as the environment receives it: the decoded text and the token ids
    the engine generated (never re-tokenised), and the turn's index from 0."""

    index: int
    text: str
    token_ids: np.ndarray  # 1-D int32


@dataclass(frozen=True, slots=True)
class Step:
    """What the environment answers to a model turn.

    observation: text for the model's next turn ("" when the episode ended).
    done: the episode ended here (a final answer, a give-up).
    latency_s: seconds the step should take (a tool's simulated wait); the worker that
        runs the step sleeps it, so it is real waiting but decided by the state and seed.
    error: a per-trajectory problem (e.g. a malformed tool call), recorded in the run's
        records; the environment decides whether the episode goes on.
    info: counters for the metrics (e.g. ``tool_calls``), plain numbers and strings.
    """

    state: EnvState
    observation: str = ""
    done: bool = False
    latency_s: float = 0.0
    error: str = ""
    info: Mapping[str, int | float | str] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """The rules of one kind of multi-turn task; see the module docstring. It may also
    declare ``columns``, the dataset fields its ``start`` reads from ``EnvSample.extra``
    (:mod:`staleflow.envs.samples` refuses rows without them)."""

    name: str

    def start(self, sample: EnvSample, seed: int) -> Episode:
        """The episode of one trajectory; ``seed`` is the trajectory's (the same on a
        resume), the only source of its randomness."""
        ...

    def step(self, state: EnvState, turn: ModelTurn) -> Step:
        """Answer one model turn. Raise only for a bug: a bad turn is ``Step.error``."""
        ...

    def score(self, state: EnvState) -> float:
        """The episode's reward, once it ended (by ``done`` or a limit)."""
        ...


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    """max_turns: model turns per trajectory (>= 1). max_tokens: response tokens per
    trajectory, model turns and observations together (the engine's own budget for a
    turn is what is left of it)."""

    max_turns: int = 4
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns={self.max_turns}; a trajectory needs at least 1 turn")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}; use at least 1 token")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What happens after a step, by :func:`after_step`: the episode goes on (``finish``
    empty) and ``observation_ids`` are appended, or it ends for ``finish`` and nothing is
    appended."""

    finish: str
    observation_ids: np.ndarray  # 1-D int32; empty when the episode ended

    @property
    def ended(self) -> bool:
        return bool(self.finish)


_NOTHING = np.zeros(0, dtype=np.int32)


def after_step(
    limits: EpisodeLimits,
    *,
    turns_done: int,
    response_tokens: int,
    step: Step,
    observation_ids: np.ndarray,
) -> Verdict:
    """The one rule of how an episode ends, used in every mode (η = 0 or not, streamed or
    not), so a truncated multi-turn trajectory ends the same way everywhere.

    ``turns_done``: model turns so far, the one just answered included;
    ``response_tokens``: the response's tokens so far (model turns and observations);
    ``observation_ids``: the step's observation as it would be appended. An episode the
    environment ended is ``done``; else the last allowed turn ends it (``max_turns``);
    else an observation that leaves no token for the model's next turn ends it
    (``max_tokens``), and is not appended: the trajectory is scored as it stands.
    """
    if step.done:
        return Verdict(FINISH_DONE, _NOTHING)
    if turns_done >= limits.max_turns:
        return Verdict(FINISH_MAX_TURNS, _NOTHING)
    if response_tokens + len(observation_ids) >= limits.max_tokens:
        return Verdict(FINISH_MAX_TOKENS, _NOTHING)
    return Verdict("", np.asarray(observation_ids, dtype=np.int32))


def check_plain(value: object, where: str = "state") -> None:
    """Raise :class:`EnvContractError` naming the first part of ``value`` that is not
    plain data (what an environment's state must be to travel with its trajectory)."""
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise EnvContractError(f"{where} is {value}: store finite numbers only")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise EnvContractError(f"{where} has the key {key!r}: use str keys only")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise EnvContractError(
        f"{where} is a {type(value).__name__}, not plain data: an environment's state holds "
        "only None, bool, int, float, str, lists and str-keyed dicts (it travels with the "
        "trajectory), so convert it (e.g. an array with .tolist(), a tuple to a list)"
    )


def keyed_uniform(seed: int, *keys: int | str) -> float:
    """A uniform draw in (0, 1) from ``seed`` and ``keys`` (e.g. the turn index): the
    same on every machine and after a resume, with no generator to carry in the state."""
    text = ":".join(map(str, (seed, *keys))).encode()
    (x,) = struct.unpack("<Q", hashlib.blake2b(text, digest_size=8).digest())
    return (x + 0.5) / 2.0**64
