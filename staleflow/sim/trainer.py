"""Simulated trainer and parameter server version (paper §5.1, Appendix A.1, Figure 21).

A training step on sequences of lengths ``L_j`` takes ``a*sum(L_j) + c*sum(L_j**2) + b``
seconds: ``a`` for the linear layers (the same per token), ``c`` for causal attention,
whose cost grows with the square of each sequence's length. When it ends, the
training workers Push the new weights to the PS; the Push overlaps the next step (it
only has to finish before that step's optimizer update), and the PS version advances
when the Push finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class TrainerCosts:
    """seconds_per_token (a), step_overhead_s (b), push_s (one Push to the PS),
    seconds_per_token_sq (c, per squared sequence length: causal attention)."""

    seconds_per_token: float = 2.0e-5
    step_overhead_s: float = 10.0
    push_s: float = 3.0
    seconds_per_token_sq: float = 0.0

    def __post_init__(self) -> None:
        for name in ("seconds_per_token", "step_overhead_s", "push_s", "seconds_per_token_sq"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"TrainerCosts.{name} must be >= 0 (got {getattr(self, name)})")

    def sped_up(self, factor: float) -> TrainerCosts:
        """The same trainer on ``factor`` times the GPUs (per-token costs divide by it)."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0 (got {factor})")
        return replace(
            self,
            seconds_per_token=self.seconds_per_token / factor,
            seconds_per_token_sq=self.seconds_per_token_sq / factor,
        )

    def step_seconds(self, tokens: int, squares: int = 0) -> float:
        """A step over ``tokens`` tokens whose sequences' squared lengths sum to ``squares``."""
        return (
            self.seconds_per_token * tokens
            + self.seconds_per_token_sq * squares
            + self.step_overhead_s
        )


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
    step_starts: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    _current: tuple[int, float] = (0, 0.0)  # tokens and compute time of the running step

    def start_step(self, now: float, tokens: int, squares: int = 0) -> float:
        """Begin a step on ``tokens`` tokens (sequences' squared lengths summing to
        ``squares``); returns when it ends."""
        duration = self.costs.step_seconds(tokens, squares)
        # The optimizer update of this step waits for the previous Push (Figure 21).
        end = max(now + duration, self.push_until)
        self.busy, self.busy_until = True, end
        self.step_starts.append(now)
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
