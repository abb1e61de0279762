"""A run's summary as one typed record: ``summary.json`` of a real launch
(:class:`RunSummary`), and the figures it shares with a simulated run's summary
(:class:`RunFigures`, the base of both: ``staleflow.sim.summary.Summary`` derives from it).

:class:`RunSummary` keeps ``summary.json``'s keys exactly as the launcher has always
written them, so folders written before it open unchanged; a key it does not know (a
newer launcher's, or an older one's since dropped) is kept in :attr:`RunSummary.extra`
and written back, so reading and rewriting a summary loses nothing. The file itself is
read and written by :class:`staleflow.runfolder.layout.RunLayout`.

Standard library only: the simulator imports this module, so it stands below both.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

F = TypeVar("F", float, float | None)
H = TypeVar("H", dict[int, int], dict[int, int] | None)

_HISTOGRAMS = ("staleness_hist", "token_staleness_hist")
_OWN = frozenset({"extra", "nulls"})  # the record's bookkeeping, not summary.json keys


@dataclass(frozen=True, slots=True)
class RunFigures(Generic[F, H]):
    """The figures a simulated and a real run both report, under the same names.
    ``F`` (``H``) is ``float`` (``dict[int, int]``) for the simulator, which always has
    the figure, and ``... | None`` for a launch (a run without a step, or records
    without the figure, have none).

    ``tokens_per_s``: trained tokens per second since training started;
    ``trainer_idle_ratio``: share of the run the trainer waited for Ready buffers;
    ``rollout_idle_ratio``: the rollout instances' idle share;
    ``elapsed_s``: seconds from the start of training to the end of the last step
    (virtual seconds in the simulator);
    ``staleness_hist``: consumed trajectories (not groups) per staleness
    ``V_buf - V_traj``, over every counted step.

    ``summary.json`` holds each figure under its name here; the simulator's JSON spells
    ``elapsed_s`` as it always has (:data:`SIM_JSON_KEYS`)."""

    steps: int
    tokens_per_s: F
    trainer_idle_ratio: F
    rollout_idle_ratio: F
    elapsed_s: F
    staleness_hist: H


# The one place where a shared figure's name differs from a file's key: the simulator's
# JSON (``staleflow sim --json``, ``experiments/sim_*.py``, their saved results) keeps
# the keys its readers know.
SIM_JSON_KEYS: Mapping[str, str] = {"elapsed_s": "seconds"}


@dataclass(frozen=True, slots=True)
class RunSummary(RunFigures[float | None, dict[int, int] | None]):
    """``summary.json`` of a launch (``staleflow.runtime.driver.launch.summarise``).

    A field is None when the file lacks its key or holds null there; :attr:`nulls` names
    the second kind, so that :meth:`to_json` gives back the keys it was made from: the
    step figures (``elapsed_s`` .. ``time_share``, each written even when null) only in
    a run that took a step, ``token_staleness_steps`` only for records before the
    per-step token histogram, ``filtered_*`` only with dynamic sampling, ``eval_last`` /
    ``eval_best`` only with held-out evaluations during training, and the launch's facts
    (the policy's ``source``, ``chat_template``, ``placement``, ``audit``, ``launch``:
    the id that tells this launch's summary from an earlier one's, ...) as gathered."""

    reward_start: float | None = None
    reward_end: float | None = None
    staleness_max: int | None = None
    staleness_mean: float | None = None
    corrected_frac: float | None = None
    token_staleness_hist: dict[int, int] | None = None
    on_policy_tokens: bool | None = None
    time_share: dict[str, float] | None = None
    eval_last: dict[str, float] | None = None
    eval_best: dict[str, float] | None = None
    token_staleness_steps: int | None = None
    filtered_groups: int | None = None
    filtered_frac: float | None = None
    # the launch's facts
    source: str | None = None
    resumed_from: str | None = None
    warmup_accuracy: float | None = None
    warmup_steps: int | None = None
    chat_template: str | None = None
    eval_problems: int | None = None
    eval_reward_start: float | None = None
    eval_reward_end: float | None = None
    prepare_s: float | None = None
    placement: dict[str, Any] | None = None
    audit: dict[str, Any] | None = None
    stopped: bool | None = None
    resume_from: str | None = None
    launch: str | None = None
    # keys this version does not know, kept as read (and written back)
    extra: dict[str, Any] = field(default_factory=dict)
    # optional fields the file held as null (an absent key reads as None too; each is
    # written back as it was read)
    nulls: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        """The mapping ``summary.json`` holds (histograms keyed by int, as ``json``
        writes them: as strings), keys as the launcher has always written them."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in _OWN and (value is not None or f.name in self.nulls):
                out[f.name] = value
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSummary:
        """The record of a ``summary.json`` mapping, from any launcher version: a missing
        key reads as None (``steps`` as 0), an unknown one goes to :attr:`extra`."""
        known = {f.name for f in dataclasses.fields(cls)} - _OWN
        values: dict[str, Any] = {k: v for k, v in data.items() if k in known}
        for key in _HISTOGRAMS:  # JSON object keys are strings; the histograms' are ints
            hist = values.get(key)
            if isinstance(hist, Mapping):
                # not a histogram this version wrote: keep it as read
                with contextlib.suppress(ValueError):
                    values[key] = {int(k): v for k, v in hist.items()}
        nulls = frozenset(k for k, v in values.items() if v is None)
        values.setdefault("steps", 0)  # the launcher always writes it: {} is a broken file
        for f in dataclasses.fields(RunFigures):  # a launch may lack any figure but steps
            values.setdefault(f.name, None)
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**values, extra=extra, nulls=nulls)


def audit_balanced(audit: Mapping[str, Any] | None) -> bool:
    """Whether a finished run's audit (``summary.json``'s ``audit``) accounts for every
    trajectory the TS created: consumed, aborted, dropped by dynamic sampling, or still
    queued or completed for a next step, and none left routed, on an instance or
    rewarding once the run stopped."""
    if not audit:
        return False
    ended = int(audit["consumed"]) + int(audit["aborted"]) + int(audit.get("filtered", 0))
    left = sum(int(audit.get(k, 0)) for k in ("routed", "on_instances", "rewarding"))
    return left == 0 and int(audit["created"]) == ended + int(audit["queued"]) + int(
        audit["completed"]
    )
