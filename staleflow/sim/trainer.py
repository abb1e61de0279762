"""Simulated trainer and parameter server version (paper §5.1, Appendix A.1, Figure 21).

A training step on sequences of lengths ``L_j`` takes ``a*sum(L_j) + c*sum(L_j**2) + b``
seconds: ``a`` for the linear layers (the same per token), ``c`` for causal attention,
whose cost grows with the square of each sequence's length. When it ends, the
training workers Push the new weights to the PS; the Push overlaps the next step (it
only has to finish before that step's optimizer update), and the PS version advances
when the Push finishes.

Streamed training (RolloutPipe's complete-group pipelining, ``ClusterConfig.stream_training``):
while its buffer is not Ready, the idle trainer runs forward and backward on groups already
occupied in it (``stream``), at ``a*sum(L_j) + c*sum(L_j**2)`` for those groups and no
``b``; the step at Consume then pays only for the groups not streamed, plus ``b``, and
its optimizer update still waits for the previous Push. The version does not move before
the step, so staleness is unchanged.
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

    def work_seconds(self, tokens: int, squares: int = 0) -> float:
        """Forward and backward alone over such sequences: a step without its overhead."""
        return self.seconds_per_token * tokens + self.seconds_per_token_sq * squares


@dataclass(slots=True)
class SimTrainer:
    """Trainer state on the virtual clock; the cluster's event loop drives it.

    The per-step lists hold one entry per finished step. ``step_starts`` are the Consumes;
    work streamed before one is in ``step_stream_s`` (its compute seconds),
    ``step_stream_groups`` / ``step_stream_tokens``, and ``step_firsts`` holds when the
    step's first work began (its start when nothing was streamed)."""

    costs: TrainerCosts
    ps_version: int = 0  # the PS's latest version (advanced when a Push lands)
    busy_until: float = 0.0  # end of the running step or streamed work (or of the last)
    push_until: float = 0.0  # end of the latest Push
    busy: bool = False
    steps: int = 0
    tokens: int = 0
    busy_time: float = 0.0
    step_starts: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_firsts: list[float] = field(default_factory=list)
    step_stream_s: list[float] = field(default_factory=list)
    step_stream_groups: list[int] = field(default_factory=list)
    step_stream_tokens: list[int] = field(default_factory=list)
    version_times: list[float] = field(default_factory=list)  # version v landed at [v - 1]
    # the running step: tokens, compute seconds, streamed (seconds, groups, tokens), first
    _current: tuple[int, float, tuple[float, int, int], float] = (0, 0.0, (0.0, 0, 0), 0.0)
    _ahead_s: float = 0.0  # compute seconds streamed for the buffer not yet consumed
    _ahead_start: float | None = None

    def stream(self, now: float, tokens: int, squares: int = 0) -> float:
        """Run forward and backward on groups of the buffer not yet Ready (``tokens``
        tokens, squared lengths summing to ``squares``); returns when that work ends."""
        duration = self.costs.work_seconds(tokens, squares)
        self.busy, self.busy_until = True, now + duration
        if self._ahead_start is None:
            self._ahead_start = now
        self._ahead_s += duration
        return self.busy_until

    def stream_done(self) -> None:
        self.busy = False

    def start_step(
        self, now: float, tokens: int, squares: int = 0, streamed: tuple[int, int] = (0, 0)
    ) -> float:
        """Begin a step on ``tokens`` tokens not streamed yet (sequences' squared lengths
        summing to ``squares``); ``streamed``: the (groups, tokens) of the batch that were.
        Returns when the step ends."""
        duration = self.costs.step_seconds(tokens, squares)
        # The optimizer update of this step waits for the previous Push (Figure 21).
        end = max(now + duration, self.push_until)
        self.busy, self.busy_until = True, end
        self.step_starts.append(now)
        first = now if self._ahead_start is None else self._ahead_start
        # Streamed groups that left the buffer before the Consume (none do in the
        # simulator) keep their seconds here: the trainer did spend them.
        ahead = (self._ahead_s, streamed[0], streamed[1])
        self._current = (tokens + streamed[1], duration, ahead, first)
        self._ahead_s, self._ahead_start = 0.0, None
        return end

    def finish_step(self, now: float) -> float:
        """The step ended at ``now``; returns when its Push lands on the PS."""
        self.busy = False
        self.steps += 1
        tokens, duration, (ahead_s, ahead_groups, ahead_tokens), first = self._current
        self.tokens += tokens  # counted when the step is done, as the paper's throughput
        self.step_tokens.append(tokens)
        self.busy_time += duration + ahead_s
        self.step_ends.append(now)
        self.step_firsts.append(first)
        self.step_stream_s.append(ahead_s)
        self.step_stream_groups.append(ahead_groups)
        self.step_stream_tokens.append(ahead_tokens)
        self.push_until = now + self.costs.push_s
        return self.push_until

    def push_landed(self, now: float) -> None:
        self.ps_version += 1
        self.version_times.append(now)
