"""``summary.json`` and the final table cover the whole run across resumes (issue 32: an
8-step run resumed after step 4 said ``3:1024``, the steps after the resume only): the
launcher passes the checkpoint's records and its own, and the summary is computed from
them, so it agrees with the whole ``metrics.jsonl``. The real resumed launch is checked
in ``tests/staleflow/recovery/test_chaos.py``."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from rich.console import Console

from staleflow.runfolder.step_record import StepRecord, speculation_keys
from staleflow.runtime.driver.display import summary_table
from staleflow.runtime.driver.launch import summarise


def _record(step: int, staleness: dict[int, int], tokens: dict[int, int]) -> StepRecord:
    return StepRecord(
        step=step,
        version=step - 1,
        elapsed_s=float(step),
        staleness=staleness,
        token_staleness=tokens,
    )


def test_the_summary_of_a_resumed_run_counts_every_step_in_metrics_jsonl():
    before = [_record(s, {0: 4, 1: 4}, {0: 40, 1: 8}) for s in range(1, 5)]  # the checkpoint's
    after = [_record(s, {1: 8}, {1: 64, 2: 1}) for s in range(5, 9)]  # this launch's
    flat = [r.to_flat() for r in before + after]  # what metrics.jsonl holds
    records = [StepRecord.from_flat(f) for f in flat]
    record = summarise(records, {})
    summary = record.to_json()  # what summary.json holds
    whole: Counter[int] = Counter()
    tokens: Counter[int] = Counter()
    for r in records:
        whole.update(r.staleness)
        tokens.update(r.token_staleness)
    assert summary["steps"] == 8
    assert summary["staleness_hist"] == dict(whole) == {0: 16, 1: 48}
    assert summary["token_staleness_hist"] == dict(tokens) == {0: 160, 1: 288, 2: 4}
    assert summary["staleness_max"] == 1 and "token_staleness_steps" not in summary
    console = Console(width=120, record=True)
    console.print(summary_table(record, eta=3))
    text = console.export_text()
    assert "0:16 1:48" in text and "8" in text


def test_records_written_before_the_token_histogram_say_how_many_steps_it_covers():
    old = StepRecord.from_flat(
        {"step": 1.0, "version": 0.0, "time/elapsed_s": 1.0, "staleness/hist/0": 8.0}
    )
    new = _record(2, {1: 8}, {1: 80})
    summary = summarise([old, new], {}).to_json()
    assert summary["staleness_hist"] == {0: 8, 1: 8}
    assert summary["token_staleness_hist"] == {1: 80}
    assert summary["token_staleness_steps"] == 1


def test_the_speculation_counters_of_the_last_step_reach_the_summary_only_when_on():
    plain = [_record(s, {0: 4}, {0: 40}) for s in (1, 2)]
    assert not any(k.startswith("speculation") for k in summarise(plain, {}).to_json())
    # cumulative counters: the summary takes the last step's, not a sum over steps
    spec = [
        replace(plain[0], extra=speculation_keys(10, 40, 20)),
        replace(plain[1], extra=speculation_keys(30, 100, 70)),
    ]
    flat = [StepRecord.from_flat(r.to_flat()) for r in spec]  # as metrics.jsonl holds them
    summary = summarise(flat, {}).to_json()
    assert summary["speculation_verifications"] == 30
    assert summary["speculation_accepted"] == 70 and summary["speculation_wasted"] == 30
    assert summary["speculation_accepted_per_verification"] == 70 / 30
