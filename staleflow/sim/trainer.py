"""Simulated trainer and parameter server version (paper §5.1, Appendix A.1, Figure 21).

A training step on ``tokens`` tokens takes ``a*tokens + b`` seconds. When it ends, the
training workers Push the new weights to the PS; the Push overlaps the next step (it
only has to finish before that step's optimizer update), and the PS version advances
when the Push finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TrainerCosts:
    """seconds_per_token (a), step_overhead_s (b), push_s (one Push to the PS)."""

    seconds_per_token: float = 2.0e-5
    step_overhead_s: float = 10.0
    push_s: float = 3.0

    def step_seconds(self, tokens: int) -> float:
        return self.seconds_per_token * tokens + self.step_overhead_s


@dataclass(slots=True)
class SimTrainer:
    """Trainer state on the virtual clock; the cluster's event loop drives it."""

    costs: TrainerCosts
    ps_version: int = 0  # the PS's latest version (advanced when a Push lands)
    busy_until: float = 0.0  # end of the running step (or of the last one)
    push_until: float = 0.0  # end of the latest Push
    busy: bool = False
    steps: int = 0
    tokens: int = 0
    busy_time: float = 0.0
    step_ends: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    _current: tuple[int, float] = (0, 0.0)  # tokens and compute time of the running step

    def start_step(self, now: float, tokens: int) -> float:
        """Begin a step on ``tokens`` tokens; returns when it ends."""
        duration = self.costs.step_seconds(tokens)
        # The optimizer update of this step waits for the previous Push (Figure 21).
        end = max(now + duration, self.push_until)
        self.busy, self.busy_until = True, end
        self._current = (tokens, duration)
        return end

    def finish_step(self, now: float) -> float:
        """The step ended at ``now``; returns when its Push lands on the PS."""
        self.busy = False
        self.steps += 1
        tokens, duration = self._current
        self.tokens += tokens  # counted when the step is done, as the paper's throughput
        self.step_tokens.append(tokens)
        self.busy_time += duration
        self.step_ends.append(now)
        self.push_until = now + self.costs.push_s
        return self.push_until

    def push_landed(self) -> None:
        self.ps_version += 1
