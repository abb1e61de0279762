"""Simulated RL workload: prompt lengths and per-group response lengths.

Two sources satisfy the trajectory server's ``PromptSource`` contract:

- :class:`SyntheticWorkload` draws a difficulty per prompt group; the group's responses
  share it, so lengths are correlated within a group and heavy-tailed across groups, and
  the maximum response length caps them (a point mass at the cap). Parameters and where
  they come from are in :class:`WorkloadConfig` and ``docs/simulator.md``.
- :class:`TraceWorkload` replays recorded response lengths per group from a CSV or JSONL
  file, for calibrating the simulator against a real run.

Both hand the simulated engine the target response length of each trajectory through
:meth:`response_length`; the engine never sees tokens, only counts.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


class TraceError(ValueError):
    """A trace file row is malformed; the message names the file, row and field."""


@dataclass(frozen=True, slots=True, eq=False)
class SimSample:
    """One simulated prompt (satisfies ``trajectory_server.SampleLike``)."""

    sample_id: int
    prompt_ids: np.ndarray  # 1-D int32, only its length matters
    answer: str
    response_lengths: tuple[int, ...]  # target response length of each member, in order


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Synthetic response-length model (lengths in tokens).

    A group's median response length is ``exp(N(log(group_median_frac * max_response),
    group_sigma))``; each member multiplies it by ``exp(N(0, member_sigma))``; lengths are
    capped at ``max_response`` (the finish reason is then "length").

    Why these defaults (no paper reports numeric fits, only figures and statements):
    - ``group_median_frac = 0.25``: Seer §2.2 reports average output lengths of "tens of
      thousands" of tokens against caps of 40K-98K (Table 5), i.e. a mean of roughly a
      third of the cap; with the lognormal tail the mean here is about 0.33 x cap.
    - ``group_sigma = 0.9``: Seer Figure 2 shows lengths spanning "from hundreds" of tokens
      to the cap; with 0.9 the 2.5th percentile of group medians is ~0.04 x cap (~860
      tokens at a 20K cap) and ~7% of trajectories hit the cap.
    - ``member_sigma = 0.3``: Seer §3.2 / Figure 4 and StaleFlow Appendix C: responses
      of a group are "either all long or all short"; 0.3 against 0.9 puts ~90% of the
      log-length variance between groups (intra-class correlation ~0.9).
    - prompts: StaleFlow §6.1 caps prompts at 2K; math prompts (DAPO-Math-17k) are short,
      so a lognormal with median 200 tokens and sigma 0.5, capped at ``max_prompt``.

    Two optional shapes (off by default; ``staleflow.sim.presets.WORKLOADS`` names them):
    - bimodal (``long_frac > 0``): a group is "long" with probability ``long_frac`` and then
      draws its median around ``long_median_frac x max_response`` with ``long_sigma``;
      other groups keep the distribution above;
    - within-group outliers (``outlier_prob > 0``): each member independently, with that
      probability, runs away to ``outlier_frac x max_response`` whatever its group's
      length (a repetition loop that only the cap stops).
    """

    max_response: int = 20_000
    group_median_frac: float = 0.25
    group_sigma: float = 0.9
    member_sigma: float = 0.3
    min_response: int = 16
    prompt_median: float = 200.0
    prompt_sigma: float = 0.5
    max_prompt: int = 2048
    long_frac: float = 0.0
    long_median_frac: float = 0.6
    long_sigma: float = 0.3
    outlier_prob: float = 0.0
    outlier_frac: float = 1.0

    def __post_init__(self) -> None:
        if self.max_response < self.min_response or self.min_response < 1:
            raise ValueError(
                f"need 1 <= min_response ({self.min_response}) <= max_response "
                f"({self.max_response})"
            )
        if not 0.0 < self.group_median_frac <= 1.0:
            raise ValueError(f"group_median_frac={self.group_median_frac}; use (0, 1]")
        if self.group_sigma < 0 or self.member_sigma < 0 or self.prompt_sigma < 0:
            raise ValueError("sigmas must be >= 0")
        if not 1.0 <= self.prompt_median <= self.max_prompt:
            raise ValueError(f"prompt_median={self.prompt_median}; use [1, max_prompt]")
        for name in ("long_frac", "outlier_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)}; use a probability in [0, 1]")
        for name in ("long_median_frac", "outlier_frac"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(
                    f"{name}={getattr(self, name)}; use a fraction of the cap in (0, 1]"
                )
        if self.long_sigma < 0:
            raise ValueError("sigmas must be >= 0")


class _Source:
    """Shared bookkeeping: samples handed out and their members' target lengths."""

    def __init__(self, members: int) -> None:
        if members < 1:
            raise ValueError(f"members={members}; a group has at least one trajectory")
        self.members = members
        self._by_sample: dict[int, tuple[int, ...]] = {}
        self._next_member: dict[int, int] = {}
        self._assigned: dict[int, int] = {}

    def _remember(self, sample: SimSample) -> SimSample:
        self._by_sample[sample.sample_id] = sample.response_lengths
        return sample

    def response_length(self, sample_id: int, traj_id: int) -> int:
        """Target response length of trajectory ``traj_id`` of prompt ``sample_id``.

        Members take the sample's lengths in the order they are first asked for, which is
        deterministic for a deterministic run; repeated questions get the same answer.
        """
        known = self._assigned.get(traj_id)
        if known is not None:
            return known
        lengths = self._by_sample[sample_id]
        k = self._next_member.get(sample_id, 0)
        self._next_member[sample_id] = k + 1
        length = lengths[k % len(lengths)]
        self._assigned[traj_id] = length
        return length

    def forget(self, traj_id: int) -> None:
        """Drop a finished trajectory's record (keeps memory flat over long runs)."""
        self._assigned.pop(traj_id, None)


class SyntheticWorkload(_Source):
    """Endless prompts with correlated, heavy-tailed, capped response lengths."""

    def __init__(self, config: WorkloadConfig, members: int, seed: int = 0) -> None:
        super().__init__(members)
        self.config = config
        self._rng = np.random.default_rng(seed)
        self._next_id = 0

    def draw_group(self) -> tuple[int, np.ndarray]:
        """(prompt length, response lengths of the group's members)."""
        c, rng = self.config, self._rng
        prompt = int(
            np.clip(round(rng.lognormal(np.log(c.prompt_median), c.prompt_sigma)), 1, c.max_prompt)
        )
        frac, sigma = c.group_median_frac, c.group_sigma
        # Extra draws only when a shape is on, so the default stream stays as it was.
        if c.long_frac > 0.0 and rng.random() < c.long_frac:
            frac, sigma = c.long_median_frac, c.long_sigma
        median = np.log(frac * c.max_response) + sigma * rng.standard_normal()
        raw = np.exp(median + c.member_sigma * rng.standard_normal(self.members))
        if c.outlier_prob > 0.0:
            runaway = rng.random(self.members) < c.outlier_prob
            raw = np.where(runaway, c.outlier_frac * c.max_response, raw)
        lengths = np.clip(np.rint(raw), c.min_response, c.max_response).astype(np.int64)
        return prompt, lengths

    def next_sample(self) -> SimSample:
        prompt, lengths = self.draw_group()
        sid = self._next_id
        self._next_id += 1
        ids = np.zeros(prompt, dtype=np.int32)
        return self._remember(SimSample(sid, ids, "", tuple(int(x) for x in lengths)))


@dataclass(frozen=True, slots=True)
class TraceGroup:
    prompt_len: int
    response_lengths: tuple[int, ...]


def _positive_int(value: object, where: str, field: str) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
    try:
        out = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise TraceError(
            f"{where}: field {field!r} must be a positive integer, got {value!r}"
        ) from None
    if out < 1:
        raise TraceError(f"{where}: field {field!r} must be a positive integer, got {value!r}")
    return out


def _lengths(value: object, where: str) -> tuple[int, ...]:
    if isinstance(value, str):
        parts: Sequence[object] = [p for p in value.replace(";", " ").split() if p]
    elif isinstance(value, list):
        parts = value
    else:
        raise TraceError(
            f"{where}: field 'response_lengths' must be a list of integers (JSONL) or "
            f"space/semicolon-separated integers (CSV), got {value!r}"
        )
    if not parts:
        raise TraceError(f"{where}: field 'response_lengths' is empty")
    return tuple(_positive_int(p, where, "response_lengths") for p in parts)


def read_trace(path: str | Path) -> list[TraceGroup]:
    """Groups of a trace file: CSV or JSONL with ``prompt_len`` and ``response_lengths``.

    JSONL: one object per line, ``{"prompt_len": 180, "response_lengths": [912, 1040]}``.
    CSV: a header with ``prompt_len,response_lengths``; lengths separated by spaces or
    semicolons. Rows are numbered from 1 (the CSV header is row 0).
    """
    path = Path(path)
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    rows: Iterator[tuple[int, object]]
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        missing = {"prompt_len", "response_lengths"} - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{path}: row 0 (header): missing field(s) {sorted(missing)}")
        rows = ((i, dict(r)) for i, r in enumerate(reader, start=1))
    else:
        rows = _json_rows(path, text)
    out = []
    for i, row in rows:
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise TraceError(f"{where}: expected an object, got {type(row).__name__}")
        for field in ("prompt_len", "response_lengths"):
            if row.get(field) in (None, ""):
                raise TraceError(f"{where}: field {field!r} is missing")
        out.append(
            TraceGroup(
                _positive_int(row["prompt_len"], where, "prompt_len"),
                _lengths(row["response_lengths"], where),
            )
        )
    if not out:
        raise TraceError(f"{path}: the trace holds no groups")
    return out


def _json_rows(path: Path, text: str) -> Iterator[tuple[int, object]]:
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}: row {i}: not valid JSON ({e.msg})") from None


class TraceWorkload(_Source):
    """Replays a trace's groups in order, cycling when ``cycle`` is set (else exhausts).

    A group with fewer recorded lengths than the run's trajectories per group reuses them
    cyclically; that is logged once, since it repeats lengths.
    """

    def __init__(self, groups: Sequence[TraceGroup], members: int, *, cycle: bool = True) -> None:
        super().__init__(members)
        if not groups:
            raise TraceError("a trace workload needs at least one group")
        self.groups = list(groups)
        self.cycle = cycle
        self._next_id = 0
        if any(len(g.response_lengths) < members for g in self.groups):
            logger.warning("trace groups shorter than %d members reuse their lengths", members)

    @classmethod
    def from_file(cls, path: str | Path, members: int, *, cycle: bool = True) -> TraceWorkload:
        return cls(read_trace(path), members, cycle=cycle)

    def next_sample(self) -> SimSample | None:
        sid = self._next_id
        if sid >= len(self.groups) and not self.cycle:
            return None
        self._next_id += 1
        g = self.groups[sid % len(self.groups)]
        ids = np.zeros(g.prompt_len, dtype=np.int32)
        return self._remember(SimSample(sid, ids, "", g.response_lengths))
