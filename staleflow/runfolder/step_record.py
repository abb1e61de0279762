"""The per-step record of a run: one :class:`StepRecord` per training step, its flat form
(one line of ``metrics.jsonl``, one item of the dashboard's ``/api/metrics``) and its
reader.

``staleflow.runtime.controller.metrics`` builds the records of a real run, the dashboard's simulated
source those of a simulation; ``staleflow launch`` writes them, and the dashboard,
``staleflow status`` and the figure scripts read them back through :func:`read_records` /
:meth:`StepRecord.from_flat`. No module spells a metric key but this one.

The flat form maps ``area/name`` keys to numbers (docs/launch.md lists them):

- one key per scalar field (its ``key`` in the field's metadata, e.g. ``time/elapsed_s``);
- one key per item of a per-instance or per-kind field: ``staleness/hist/<k>``,
  ``staleness/token_hist/<k>``, ``rollout/idle_ratio/<inst>``, ``rollout/version/<inst>``,
  ``rollout/time_share/<kind>``, ``coordinator/latency_s/<kind>``;
- the derived keys ``staleness/mean``, ``staleness/max``, ``rollout/idle_ratio`` (mean
  over instances) and ``rollout/time_share/commands`` (Pull + Route + Interrupt), written
  for charts and recomputed, never trusted, on reading;
- every other key (the trainer's ``train/*`` metrics, keys of a newer version) as is, in
  :attr:`StepRecord.extra`.

Records written by earlier versions read unchanged: the keys have not moved. This module
needs only the standard library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordinator.freshness import FreshnessState

TABLE3 = ("pull", "route", "interrupt", "prefill", "decode")  # rollout time shares
COMMAND_SHARES = ("pull", "route", "interrupt")  # Table 3's command columns


class RecordError(ValueError):
    """A record (or a ``metrics.jsonl`` line) that cannot be read; the message names the
    key, or the file and line, and what is wrong."""


def _scalar(key: str, *, whole: bool = False) -> Any:
    return field(default=None, metadata={"key": key, "whole": whole})


def _per(prefix: str, *, whole: bool = False, by_int: bool = True) -> Any:
    return field(
        default_factory=dict, metadata={"prefix": prefix, "whole": whole, "by_int": by_int}
    )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One training step. Times are seconds since training started (wall time of a real
    run, virtual time of a simulated one); ratios are shares in [0, 1]. ``None``: the
    source does not know it (a simulation grades no rewards; older runs lack keys)."""

    step: int = field(metadata={"key": "step", "whole": True})  # 1 for the first step
    version: int = field(metadata={"key": "version", "whole": True})  # V_buf consumed
    elapsed_s: float = field(metadata={"key": "time/elapsed_s", "whole": False})
    step_s: float | None = _scalar("time/step_s")
    tokens_per_s: float | None = _scalar("throughput/tokens_per_s")  # trained, since start
    step_tokens_per_s: float | None = _scalar("throughput/step_tokens_per_s")
    tokens: int | None = _scalar("train/tokens", whole=True)
    trajectories: int | None = _scalar("train/trajectories", whole=True)
    trainer_wait_s: float | None = _scalar("trainer/wait_s")  # for buffer `version` Ready
    trainer_train_s: float | None = _scalar("trainer/train_s")
    trainer_push_wait_s: float | None = _scalar("trainer/push_wait_s")
    trainer_idle_ratio: float | None = _scalar("trainer/idle_ratio")  # of this step
    rewarded: int | None = _scalar("rollout/rewarded", whole=True)  # since the last step
    reward_errors: int | None = _scalar("rollout/reward_errors", whole=True)
    truncated: int | None = _scalar("rollout/truncated", whole=True)
    reward_mean: float | None = _scalar("rollout/reward_mean")
    response_len_mean: float | None = _scalar("rollout/response_len_mean")
    ps_version: int | None = _scalar("ps/version", whole=True)
    cycles: int | None = _scalar("coordinator/cycles", whole=True)
    discarded: int | None = _scalar("coordinator/discarded", whole=True)
    commands: int | None = _scalar("coordinator/commands", whole=True)
    # the coordinator's decisions during this step: how many, and their CPU time (the
    # deciding thread's; median and max) against bench_coordinator.py's 10 ms target
    decisions: int | None = _scalar("coordinator/decisions", whole=True)
    decision_ms: float | None = _scalar("coordinator/decision_ms")
    decision_ms_max: float | None = _scalar("coordinator/decision_ms_max")
    # Seer (coordinator/seer.py): chunks handed back to the TS at a chunk boundary so far,
    # and the probes' mean shortfall against their group's longest response
    chunks: int | None = _scalar("rollout/chunks", whole=True)
    probe_error: float | None = _scalar("coordinator/probe_error")
    # RolloutPipe (trainer.stream): groups trained on before this step's buffer was Ready
    streamed_groups: int | None = _scalar("trainer/streamed_groups", whole=True)
    # multi-turn episodes (staleflow.envs) rewarded since the last step: model turns per
    # episode, tool calls, environment errors, seconds their tools took (summed)
    turns_mean: float | None = _scalar("env/turns_mean")
    tool_calls: int | None = _scalar("env/tool_calls", whole=True)
    env_errors: int | None = _scalar("env/errors", whole=True)
    tool_wait_s: float | None = _scalar("env/tool_wait_s")
    # the held-out evaluation of this step (eval.every, docs/evaluation.md): mean reward and
    # unbiased pass@k over eval/problems problems x eval/samples responses (pass@k at
    # eval/k), the oldest and newest policy version that sampled them, and its seconds
    eval_mean_at_k: float | None = _scalar("eval/mean_at_k")
    eval_pass_at_k: float | None = _scalar("eval/pass_at_k")
    eval_k: int | None = _scalar("eval/k", whole=True)
    eval_samples: int | None = _scalar("eval/samples", whole=True)
    eval_problems: int | None = _scalar("eval/problems", whole=True)
    eval_version: int | None = _scalar("eval/version", whole=True)
    eval_version_max: int | None = _scalar("eval/version_max", whole=True)
    eval_s: float | None = _scalar("eval/seconds")
    # V_buf - V_traj -> trajectories of this step's batch
    staleness: Mapping[int, int] = _per("staleness/hist/", whole=True)
    # V_buf - (the version that generated it) -> generated tokens of this step's batch
    token_staleness: Mapping[int, int] = _per("staleness/token_hist/", whole=True)
    # per instance, cumulative over the run: idle seconds / lifetime
    instance_idle: Mapping[int, float] = _per("rollout/idle_ratio/")
    instance_version: Mapping[int, int] = _per("rollout/version/", whole=True)
    # shares of all rollout instance-seconds so far, by TABLE3 kind
    time_share: Mapping[str, float] = _per("rollout/time_share/", by_int=False)
    # the control plane's view of each command kind, RPC and waits included (seconds)
    command_latency_s: Mapping[str, float] = _per("coordinator/latency_s/", by_int=False)
    extra: Mapping[str, float] = field(default_factory=dict)

    # -- derived ---------------------------------------------------------------------

    @property
    def staleness_mean(self) -> float | None:
        total = sum(self.staleness.values())
        return sum(k * n for k, n in self.staleness.items()) / total if total else None

    @property
    def staleness_max(self) -> int | None:
        return max((k for k, n in self.staleness.items() if n), default=None)

    @property
    def rollout_idle_ratio(self) -> float | None:
        """Mean of the instances' idle ratios."""
        ratios = list(self.instance_idle.values())
        return sum(ratios) / len(ratios) if ratios else None

    @property
    def commands_share(self) -> float | None:
        """Share of rollout time held by Pull, Route and Interrupt (Table 3)."""
        if not any(k in self.time_share for k in COMMAND_SHARES):
            return None
        return sum(self.time_share.get(k, 0.0) for k in COMMAND_SHARES)

    def time_shares(self) -> dict[str, float]:
        """Table 3's shares by kind, with ``commands`` (Pull + Route + Interrupt)."""
        shares = dict(self.time_share)
        if self.commands_share is not None:
            shares["commands"] = self.commands_share
        return shares

    @property
    def instances(self) -> list[int]:
        return sorted(set(self.instance_idle) | set(self.instance_version))

    # -- the flat form ---------------------------------------------------------------

    def scalars(self) -> dict[str, float]:
        """The known single values by flat key: the scalar fields, the derived means and
        maxima, and :attr:`extra` (not the per-instance and per-kind items)."""
        out: dict[str, float] = {}
        for f in _SCALARS:
            value = getattr(self, f.name)
            if value is not None:
                out[f.metadata["key"]] = float(value)
        for key, value in (
            (STALENESS_MEAN, self.staleness_mean),
            (STALENESS_MAX, self.staleness_max),
            (ROLLOUT_IDLE, self.rollout_idle_ratio),
        ):
            if value is not None:
                out[key] = float(value)
        for key, value in self.extra.items():
            out.setdefault(key, float(value))
        return out

    def to_flat(self) -> dict[str, float]:
        out = self.scalars()
        for f in _MAPPINGS:
            prefix = f.metadata["prefix"]
            for k, v in sorted(getattr(self, f.name).items()):
                out[f"{prefix}{k}"] = float(v)
        if self.commands_share is not None:
            out[COMMANDS_SHARE] = self.commands_share
        return out

    def to_json(self) -> str:
        """One ``metrics.jsonl`` line, without its newline."""
        return json.dumps(self.to_flat(), sort_keys=True)

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> StepRecord:
        """Read a flat record; :class:`RecordError` names the first bad key."""
        values: dict[str, float] = {}
        for key, value in flat.items():
            if isinstance(value, bool) or not _is_number(value):
                raise RecordError(f"{str(key)!r} is not a number: {value!r}")
            values[str(key)] = float(value)
        kwargs: dict[str, Any] = {}
        for f in _SCALARS:
            key = f.metadata["key"]
            if key in values:
                kwargs[f.name] = _value(key, values.pop(key), f.metadata["whole"])
        missing = [f.metadata["key"] for f in _REQUIRED if f.name not in kwargs]
        if missing:
            raise RecordError(
                f"{missing[0]!r} is missing: every step record has "
                f"{', '.join(repr(f.metadata['key']) for f in _REQUIRED)}"
            )
        if not math.isfinite(kwargs["elapsed_s"]):
            raise RecordError(f"'time/elapsed_s' is {kwargs['elapsed_s']}: not a time")
        for key in _DERIVED:
            values.pop(key, None)
        for f in _MAPPINGS:
            prefix, items = f.metadata["prefix"], {}
            for key in [k for k in values if k.startswith(prefix)]:
                name = key[len(prefix) :]
                if f.metadata["by_int"] and not name.isdigit():
                    continue  # not ours: kept in extra
                whole = f.metadata["whole"]
                items[int(name) if f.metadata["by_int"] else name] = _value(
                    key, values.pop(key), whole
                )
            kwargs[f.name] = dict(sorted(items.items()))
        return cls(**kwargs, extra=values)

    @classmethod
    def from_json(cls, line: str | bytes) -> StepRecord:
        """One ``metrics.jsonl`` line; :class:`RecordError` says what is wrong."""
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise RecordError(f"not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise RecordError(f"expected a JSON object, got {type(data).__name__}")
        return cls.from_flat(data)


_SCALARS = tuple(f for f in fields(StepRecord) if "key" in f.metadata)
_MAPPINGS = tuple(f for f in fields(StepRecord) if "prefix" in f.metadata)
_REQUIRED = _SCALARS[:3]  # step, version, time/elapsed_s
STEP, VERSION, ELAPSED = (f.metadata["key"] for f in _REQUIRED)
STALENESS_MEAN, STALENESS_MAX = "staleness/mean", "staleness/max"
# the trainer's share of a step's tokens the off-policy correction clipped or masked
# (staleflow/trainers/rl.py), shown beside the staleness it grows with
CORRECTED = "train/corrected_frac"


def freshness_keys(state: FreshnessState) -> dict[str, float]:
    """The freshness rule at the step (``coordinator.freshness.FreshnessState``), for
    ``extra``: seconds a new group needs (estimate + margin), the margin, the trainer's
    measured step, the groups held back at the last cycle, and 1 while it gives way."""
    return {
        "freshness/need_s": float(state.need_s),
        "freshness/margin_s": float(state.margin_s),
        "freshness/step_s": float(state.step_s),
        "freshness/held_groups": float(state.held_groups),
        "freshness/giving_way": float(state.giving_way),
    }


SPECULATION = ("verifications", "drafted", "accepted")  # the counters, summed


def speculation_keys(verifications: int, drafted: int, accepted: int) -> dict[str, float]:
    """Speculative decoding's counters (docs/speculation.md), summed over the instances
    since the run started, for ``extra``: drafts verified, draft tokens, accepted ones,
    the rejected ones (``wasted``) and the accepted tokens per verification."""
    return {
        "speculation/verifications": float(verifications),
        "speculation/drafted": float(drafted),
        "speculation/accepted": float(accepted),
        "speculation/wasted": float(drafted - accepted),
        "speculation/accepted_per_verification": accepted / verifications if verifications else 0.0,
    }


SPECULATION_BY_METHOD = "speculation/method/"  # + method + "/" + counter


def speculation_method_keys(by_method: Mapping[str, tuple[int, int, int]]) -> dict[str, float]:
    """The counters per draft method (``group``, ``own``, ``off``; a race copy may draft
    with another method than its original), ``(verifications, drafted, accepted)`` each,
    for ``extra``: ``speculation/method/<method>/<counter>``."""
    return {
        f"{SPECULATION_BY_METHOD}{m}/{name}": float(n)
        for m, counts in sorted(by_method.items())
        for name, n in zip(SPECULATION, counts, strict=True)
    }


def speculation_method_counts(extra: Mapping[str, float]) -> dict[str, tuple[int, int, int]]:
    """The counters :func:`speculation_method_keys` wrote into a record's ``extra``."""
    found: dict[str, dict[str, int]] = {}
    for key, value in extra.items():
        if key.startswith(SPECULATION_BY_METHOD):
            method, _, name = key.removeprefix(SPECULATION_BY_METHOD).rpartition("/")
            found.setdefault(method, {})[name] = int(value)
    return {
        m: (c["verifications"], c["drafted"], c["accepted"])
        for m, c in found.items()
        if all(name in c for name in SPECULATION)
    }


def speculation_counts(extra: Mapping[str, float]) -> tuple[int, int, int] | None:
    """The counters :func:`speculation_keys` wrote into a record's ``extra`` (None: none)."""
    keys = [f"speculation/{name}" for name in SPECULATION]
    if not all(k in extra for k in keys):
        return None
    v, d, a = (int(extra[k]) for k in keys)
    return v, d, a


FILTERED_GROUPS = "rollout/filtered_groups"
FILTERED_FRAC = "rollout/filtered_frac"
SAMPLED_GROUPS = "rollout/sampled_groups"
FLAT_KEPT = "rollout/flat_kept_groups"


def sampling_keys(completed: int, filtered: int, flat_kept: int) -> dict[str, float]:
    """Dynamic sampling during the step (``staleflow.control.dynamic_sampling``), for
    ``extra``: groups that reached ``G`` completions, those dropped because their rewards
    were all equal and their share, and uniform groups kept because the step's budget
    (``trainer.dynamic_sampling_max_drop``) was spent."""
    return {
        SAMPLED_GROUPS: float(completed),
        FILTERED_GROUPS: float(filtered),
        FILTERED_FRAC: filtered / completed if completed else 0.0,
        FLAT_KEPT: float(flat_kept),
    }


def filtered_share(records: Iterable[StepRecord]) -> tuple[int, float] | None:
    """Groups dropped by dynamic sampling over these steps, and their share of the groups
    that completed; None if no record has the keys (dynamic sampling off)."""
    done = [r.extra for r in records if FILTERED_GROUPS in r.extra]
    if not done:
        return None
    filtered = int(sum(e[FILTERED_GROUPS] for e in done))
    sampled = sum(e.get(SAMPLED_GROUPS, 0.0) for e in done)
    return filtered, filtered / sampled if sampled else 0.0


ROLLOUT_IDLE = "rollout/idle_ratio"
COMMANDS_SHARE = "rollout/time_share/commands"
_DERIVED = (STALENESS_MEAN, STALENESS_MAX, ROLLOUT_IDLE, COMMANDS_SHARE)


def record_key(key: str) -> bool:
    """``key`` belongs to a typed field (or a derived key) of :class:`StepRecord`: a
    trainer metric of that name would be shadowed, so builders leave it out of extra."""
    return (
        any(key == f.metadata["key"] for f in _SCALARS)
        or key in _DERIVED
        or any(key.startswith(f.metadata["prefix"]) for f in _MAPPINGS)
    )


def _is_number(value: object) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _value(key: str, value: float, whole: bool) -> float | int:
    if not whole:
        return value
    if not math.isfinite(value) or not value.is_integer():
        raise RecordError(f"{key!r} is {value}: expected a whole number")
    return int(value)


# -- metrics.jsonl -----------------------------------------------------------------------


def read_records(file: Path) -> list[StepRecord]:
    """Every record of a ``metrics.jsonl``; a line that cannot be read is a
    :class:`RecordError` naming the file and the line number."""
    out = []
    with file.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(StepRecord.from_json(line))
            except RecordError as exc:
                hint = (
                    ""
                    if line.endswith(b"\n")
                    else " (an unfinished last line: is the run still writing?)"
                )
                raise RecordError(
                    f"{file} line {number}: malformed metrics record: {exc}{hint}"
                ) from None
    return out


# -- what the records say ----------------------------------------------------------------


def idle_ratio(idle_s: float, busy_s: float) -> float | None:
    """Idle share of a span split into idle and busy seconds; None before any time has
    passed. The one definition of every idle ratio: an instance's, the trainer's (its wait
    for a Ready buffer), of one step or of the whole run."""
    total = idle_s + busy_s
    return idle_s / total if total > 0 else None


def trainer_idle_ratio(records: Sequence[StepRecord]) -> float | None:
    """Share of the run the trainer spent waiting for Ready buffers (all steps)."""
    if not records:
        return None
    wait = sum(r.trainer_wait_s or 0.0 for r in records)
    return idle_ratio(wait, max(records[-1].elapsed_s - wait, 0.0))


def reward_mean(records: Iterable[StepRecord]) -> float | None:
    """Mean reward of every trajectory rewarded during these steps (each step's mean
    weighted by how many it rewarded: rewards arrive in bursts, not one batch a step)."""
    n, total = 0, 0.0
    for r in records:
        if r.reward_mean is not None and r.rewarded:
            n += r.rewarded
            total += r.reward_mean * r.rewarded
    return total / n if n else None


def evaluations(records: Iterable[StepRecord]) -> dict[str, dict[str, float]]:
    """The held-out evaluations of the run for its summary: ``eval_last`` (the latest) and
    ``eval_best`` (the highest mean@k, the earliest of equals), each with the step it was
    taken at; {} when the run took none."""
    taken = [r for r in records if r.eval_mean_at_k is not None]
    if not taken:
        return {}
    best = max(taken, key=lambda r: (r.eval_mean_at_k, -r.step))

    def entry(r: StepRecord) -> dict[str, float]:
        values = {
            "step": r.step,
            "mean_at_k": r.eval_mean_at_k,
            "pass_at_k": r.eval_pass_at_k,
            "k": r.eval_k,
            "samples": r.eval_samples,
            "problems": r.eval_problems,
            "version": r.eval_version,
            "version_max": r.eval_version_max,
        }
        return {k: v for k, v in values.items() if v is not None}

    return {"eval_last": entry(taken[-1]), "eval_best": entry(best)}


def step_busy(rec: StepRecord, prev: StepRecord | None, inst: int) -> float | None:
    """Busy share of one step: ``rollout/idle_ratio/<inst>`` is cumulative over the run
    (idle seconds / lifetime), so the step's idle seconds are the difference of
    ``ratio x elapsed``; clamped, since an instance lives slightly longer than the run's
    clock."""
    ratio = rec.instance_idle.get(inst)
    if ratio is None:
        return None
    t = rec.elapsed_s
    t0 = prev.elapsed_s if prev else 0.0
    before = prev.instance_idle.get(inst, 0.0) if prev else 0.0
    span = t - t0
    idle = ratio if span <= 0 else (ratio * t - before * t0) / span
    return min(max(1.0 - idle, 0.0), 1.0)


@dataclass(frozen=True, slots=True)
class InstanceStep:
    """One instance during one training step (Figure 17 from records)."""

    step: int
    time: float  # elapsed_s at the end of the step
    inst: int
    version: int | None  # weights version held at the end of the step
    busy_ratio: float | None  # share of the step the instance had something to generate
    pulled: bool  # its version changed during the step (a Pull of ``version``)


def instance_steps(rec: StepRecord, prev: StepRecord | None) -> list[InstanceStep]:
    """Every instance of ``rec`` against the record before it (None for the first step:
    instances start with version 0)."""
    out = []
    for inst in rec.instances:
        version = rec.instance_version.get(inst)
        before = prev.instance_version.get(inst) if prev else 0
        out.append(
            InstanceStep(
                step=rec.step,
                time=rec.elapsed_s,
                inst=inst,
                version=version,
                busy_ratio=step_busy(rec, prev, inst),
                pulled=version is not None and before is not None and version != before,
            )
        )
    return out
