"""The run summary's staleness figures (``launch.summarise``): the mean over every trained
trajectory, and beside it the share of trained tokens the off-policy correction clipped or
masked, weighted by each step's tokens."""

from __future__ import annotations

import pytest

from staleflow.runfolder.step_record import CORRECTED, StepRecord
from staleflow.runtime.driver.launch import corrected_frac, summarise


def record(
    step: int, tokens: int, corrected: float | None, staleness: dict[int, int] | None = None
) -> StepRecord:
    extra = {} if corrected is None else {CORRECTED: corrected}
    return StepRecord(
        step=step,
        version=step,
        elapsed_s=float(step),
        tokens=tokens,
        staleness=staleness or {},
        extra=extra,
    )


def test_the_summary_has_the_mean_staleness_and_the_corrected_share() -> None:
    records = [record(1, 100, 0.0, {0: 4}), record(2, 300, 0.2, {1: 2, 3: 2})]
    out = summarise(records, {}).to_json()
    assert out["staleness_mean"] == pytest.approx((0 * 4 + 1 * 2 + 3 * 2) / 8)
    assert out["corrected_frac"] == pytest.approx(0.2 * 300 / 400)  # token-weighted


def test_the_corrected_share_is_unknown_when_no_step_reported_it() -> None:
    assert corrected_frac([record(1, 100, None)]) is None
    assert corrected_frac([record(1, 0, 0.5), record(2, 0, 0.1)]) == pytest.approx(0.3)
    assert summarise([record(1, 10, None)], {}).staleness_mean is None
