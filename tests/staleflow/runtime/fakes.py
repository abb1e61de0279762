"""Fakes at the runtime's real boundaries, and only there.

Faked: the rollout engine (:class:`ScriptedEngine` emits token ``7`` each step until a
length fixed by the trajectory id, then EOS ``2``; trajectories it is told to ``hold``
never advance, standing in for the long tail that redundant rollout cuts;
:class:`PrefixKeepingEngine` also keeps, as the embedded engine's prefix store does, the
length of each turn that stopped, listed until the trajectory's next turn is submitted
there, a drop or a weight load), the trainer (:class:`CountingTrainer`
records batches and returns fixed weights), the PS (:class:`MemoryPS` holds versions in
a dict), the reward function (reward = response length parity) and, for the driver's
loops, Ray's calling convention (:class:`FakeRay`: ``handle.method.remote(...)`` runs the
method at once and ``get`` returns what it returned or raises what it raised). Everything
else (the
trajectory server, the staleness manager, the coordinator, the executor, the instance
wrapper, the reward stage and the training loop) is the real code.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from staleflow.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    EngineState,
    GenerationRequest,
    StepTimes,
)
from trajectory_server.types import TrainingBatch

EOS = 2


@dataclass(slots=True)
class _Req:
    traj_id: int
    prompt_len: int
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    max_response: int


class ScriptedEngine:
    """Deterministic continuous batching with a KV budget of whole trajectories."""

    def __init__(
        self,
        target: int = 5,
        max_running: int = 4,
        spread: int = 4,
        hold: Callable[[int], bool] | None = None,
    ) -> None:
        self.target, self.max_running, self.spread = target, max_running, spread
        self.hold = hold or (lambda traj_id: False)
        self._running: list[_Req] = []
        self._waiting: list[_Req] = []
        self._version = 0
        self.loads: list[int] = []
        self._steps = 0

    def _length(self, traj_id: int) -> int:
        return self.target + traj_id % self.spread

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        held = {r.traj_id for r in self._running + self._waiting}
        for r in requests:
            if r.traj_id in held:
                raise ValueError(f"trajectory {r.traj_id} is already here")
        for r in requests:
            self._waiting.append(
                _Req(
                    r.traj_id,
                    len(r.prompt),
                    r.tokens.tolist(),
                    r.logprobs.tolist(),
                    r.versions.tolist(),
                    r.max_response,
                )
            )

    def step(self) -> list[EngineOutput]:
        while self._waiting and len(self._running) < self.max_running:
            self._running.append(self._waiting.pop(0))
        done = []
        for r in self._running:
            if self.hold(r.traj_id):
                continue
            finished = len(r.tokens) + 1 >= self._length(r.traj_id)
            r.tokens.append(EOS if finished else 7)
            r.logprobs.append(-0.5)
            r.versions.append(self._version)
            if finished or len(r.tokens) >= r.max_response:
                done.append(r)
        self._running = [r for r in self._running if r not in done]
        self._steps += 1
        return [self._out(r, FINISH_STOP if r.tokens[-1] == EOS else FINISH_LENGTH) for r in done]

    def _out(self, r: _Req, reason: str | None) -> EngineOutput:
        return EngineOutput(
            r.traj_id,
            np.array(r.tokens, np.int32),
            np.array(r.logprobs, np.float32),
            np.array(r.versions, np.int32),
            reason,
        )

    def interrupt(self, traj_ids: Iterable[int]) -> dict[int, EngineOutput]:
        ids = set(traj_ids)
        out = {
            r.traj_id: self._out(r, None) for r in self._running + self._waiting if r.traj_id in ids
        }
        self._running = [r for r in self._running if r.traj_id not in ids]
        self._waiting = [r for r in self._waiting if r.traj_id not in ids]
        return out

    def abort(self, traj_ids: Iterable[int]) -> list[int]:
        return list(self.interrupt(traj_ids))

    def progress(self) -> dict[int, EngineOutput]:
        return {r.traj_id: self._out(r, None) for r in self._running + self._waiting}

    def load_weights(self, weights: Mapping[str, object], version: int) -> None:
        self._version = version
        self.loads.append(version)

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {}

    def state(self) -> EngineState:
        def rows(reqs: list[_Req]) -> tuple[tuple[int, int], ...]:
            return tuple((r.traj_id, r.prompt_len + len(r.tokens)) for r in reqs)

        kv = sum(r.prompt_len + len(r.tokens) for r in self._running)
        return EngineState(kv, rows(self._running), rows(self._waiting), self._version)

    def times(self) -> StepTimes:
        return StepTimes(decode_tokens=self._steps)

    @property
    def has_work(self) -> bool:
        # held trajectories alone give the generation thread nothing to do (no busy loop)
        return bool(self._waiting) or any(not self.hold(r.traj_id) for r in self._running)


class PrefixKeepingEngine(ScriptedEngine):
    """:class:`ScriptedEngine` with a prefix store's list (``engines.base.KeepsPrefixes``):
    a turn that stops leaves its length kept for the trajectory's next turn."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._kept: dict[int, int] = {}

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        super().submit(requests)
        for r in requests:
            self._kept.pop(r.traj_id, None)  # the next turn takes its prefix back

    def step(self) -> list[EngineOutput]:
        out = super().step()
        for o in out:
            if o.finish_reason == FINISH_STOP:
                self._kept[o.traj_id] = len(o.tokens)
        return out

    def load_weights(self, weights: Mapping[str, object], version: int) -> None:
        super().load_weights(weights, version)
        self._kept.clear()

    def held_prefixes(self) -> tuple[int, ...]:
        return tuple(self._kept)

    def held_prefix_sizes(self) -> tuple[tuple[int, int], ...]:
        return tuple(self._kept.items())

    def drop_prefixes(self, traj_ids: Iterable[int]) -> list[int]:
        return [t for t in traj_ids if self._kept.pop(t, None) is not None]


@dataclass
class MemoryPS:
    """Versions in a dict; ``fetch`` gives the latest."""

    versions: dict[int, dict[str, np.ndarray]] = field(default_factory=lambda: {0: {}})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def latest(self) -> int:
        with self.lock:
            return max(self.versions)

    def fetch(self, at_least: int) -> tuple[int, Mapping[str, np.ndarray]]:
        with self.lock:
            v = max(self.versions)
            assert v >= at_least, (v, at_least)
            return v, self.versions[v]

    def push(self, weights: Mapping[str, np.ndarray], version: int | None = None) -> int:
        with self.lock:
            v = max(self.versions) + 1 if version is None else version
            self.versions[v] = dict(weights)
            return v


@dataclass
class ImmediateHandle:
    version: int

    def wait(self, timeout: float | None = None) -> int:
        return self.version


@dataclass
class SyncPusher:
    ps: MemoryPS

    def push_async(self, version: int | None, weights: Mapping[str, np.ndarray]) -> ImmediateHandle:
        return ImmediateHandle(self.ps.push(weights, version))


class CountingTrainer:
    def __init__(self) -> None:
        self.version = 0
        self.batches: list[TrainingBatch] = []

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        self.batches.append(batch)
        self.version += 1
        rewards = [t.reward for g in batch.groups for t in g.trajectories]
        return {"train/reward_mean": float(np.mean(rewards))}

    def export_weights(self) -> dict[str, np.ndarray]:
        return {"w": np.full(2, self.version, np.float32)}


@dataclass(frozen=True)
class Score:
    reward: float
    error: str = ""


def parity_scorer(items: Sequence[tuple[int, str, str]]) -> list[Score]:
    return [Score(float(len(text) % 2)) for _, text, _ in items]


# -- Ray's calling convention, for driver code that polls actors ------------------------------


class ActorDied(Exception):
    """Stands in for ``ray.exceptions.RayActorError``."""


class _Ref:
    def __init__(self, call: Callable[[], object]) -> None:
        try:
            self.value, self.error = call(), None
        except Exception as exc:
            self.value, self.error = None, exc


class _Method:
    def __init__(self, fn: Callable[..., object]) -> None:
        self._fn = fn

    def remote(self, *args: object, **kwargs: object) -> _Ref:
        return _Ref(lambda: self._fn(*args, **kwargs))


class Actor:
    """``obj`` as an actor handle: every method gets a ``.remote``."""

    def __init__(self, obj: object) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))


class FakeRay:
    """``get`` / ``wait`` over :class:`Actor` calls, which have run already."""

    class exceptions:
        RayActorError = ActorDied

    def get(self, ref: _Ref, timeout: float | None = None) -> object:
        if ref.error is not None:
            raise ref.error
        return ref.value

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None):
        return list(refs), []
