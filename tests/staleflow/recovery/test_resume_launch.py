"""Resume equivalence on real Ray actors (docs/recovery.md): a run stopped at step k and
resumed trains the same number of steps in all, never a trajectory twice, every batch
within eta; the staleness manager it resumes with is the one written, field by field
(plus the completions the restore replays, which the test replays too); the trainer,
the PS and the instances go on from the checkpoint's version; the metrics continue."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from tests.staleflow.runtime.driver.launch_checks import MICRO_RUN

# two launches in one process; the chaos test (test_chaos.py) covers the same ground in
# the default suite, through the CLI
pytestmark = [pytest.mark.ray, pytest.mark.slow]

ETA, STOP_AT, MORE = 1, 3, 4


def test_a_run_stopped_at_step_k_and_resumed_trains_its_steps_once(tmp_path):
    from staleflow.config import load_config
    from staleflow.data import PromptSampler
    from staleflow.models.checkpoint import load_pretrained
    from staleflow.runtime.driver.launch import build_dataset, launch
    from staleflow.runtime.driver.resume import check_resume, restore_state
    from staleflow.runtime.driver.run_plan import plan_run
    from staleness import StalenessManager

    cfg = load_config(
        None,
        [
            f"eta={ETA}",
            "steps=100000",
            f"run_dir={tmp_path}",
            *MICRO_RUN,
            "dashboard=false",
            "eval_problems=0",
            "checkpoint_every=2",
        ],
    )
    stop = threading.Event()

    def stop_at_k(rec: Any) -> None:  # a StepRecord
        if rec.step >= STOP_AT:
            stop.set()

    first = launch(cfg, on_record=stop_at_k, stop=stop)
    assert first.stopped and first.checkpoint is not None
    k = len(first.records)
    assert k >= STOP_AT and first.checkpoint.name.startswith(f"step-{k:08d}")
    assert first.summary.resume_from == str(first.checkpoint)

    resumed_cfg, ck = check_resume(first.run_dir, [f"steps={k + MORE}"])
    assert (ck.steps, ck.version) == (k, k)
    # the manager the run resumes with is the one written, field by field, once the
    # completions that landed in the TS between the two exports are replayed
    _, tokenizer = load_pretrained(ck.trainer_dir)
    plan = plan_run(resumed_cfg)
    dataset = build_dataset(plan.task, tokenizer)
    point = restore_state(plan.trajectory_server, plan.control.sampling, ck, dataset)
    written = StalenessManager.restore(dict(ck.staleness))
    assert written.export_state() == dict(ck.staleness)
    ledger = {t: g for g, t in _members(ck.staleness)}
    for tid in point.replayed:
        written.complete(ledger[tid], tid)
    assert dict(point.staleness) == written.export_state()
    assert isinstance(point.sampler, PromptSampler)

    second = launch(resumed_cfg, resume=ck)
    assert not second.stopped
    records = second.records
    assert [r.step for r in records] == list(range(1, k + MORE + 1))  # metrics continue
    assert [s["version"] for s in second.consumed] == list(range(k, k + MORE))
    ids: Counter[int] = Counter()
    for step in first.consumed + second.consumed:
        assert len(step["traj_ids"]) == 2 * 4  # batch x group, every step
        assert min(step["staleness"]) >= 0 and max(step["staleness"]) <= ETA
        assert max(step["token_staleness"]) <= ETA
        ids.update(step["traj_ids"])
    assert len(first.consumed) + len(second.consumed) == k + MORE  # the same steps in all
    assert max(ids.values()) == 1, "a trajectory was trained on twice across the resume"
    audit = second.summary.audit
    assert audit["ps_latest"] == {"ps/0": k + MORE}  # PS and trainer went on from version k
    assert audit["consumed"] == sum(ids.values())
    assert (
        audit["created"]
        == audit["consumed"] + audit["aborted"] + audit["queued"] + audit["completed"]
    )
    assert records[-1].extra["recovery/resumed"] == 1.0


def _members(staleness):
    for g in staleness["groups"]:
        for t, _ in g["members"]:
            yield g["id"], t
