"""An environment for the sandbox test, imported by its spawned step processes (the test
puts this folder on sys.path, which the children inherit)."""

from __future__ import annotations

import os

from staleflow.envs import EnvSample, EnvState, Episode, ModelTurn, Step


class Runaway:
    """A turn that says ``loop`` runs a tool that never returns, one that says ``hog``
    allocates 2 GiB; any other turn ends the episode, scored 1."""

    name = "runaway"

    def start(self, sample: EnvSample, seed: int) -> Episode:
        return Episode(({"role": "user", "content": sample.prompt},), (), {"steps": 0})

    def step(self, state: EnvState, turn: ModelTurn) -> Step:
        if "loop" in turn.text:
            while True:  # an infinite loop: only a kill ends it
                pass
        if "hog" in turn.text:
            return Step({"steps": len(bytearray(2 << 30))})
        return Step({"steps": 1}, done=True, info={"pid": os.getpid()})

    def score(self, state: EnvState) -> float:
        return float(state["steps"])  # type: ignore[arg-type]
