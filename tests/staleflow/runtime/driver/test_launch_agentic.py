"""A real launch of the multi-turn calculator task on Ray actors: trajectories with more
than one model turn were trained, their observation tokens masked, every consumed
trajectory within eta, the audit balanced.

The policy is the micro model after a few seconds of warm-up on tool-use demonstrations
(``launch_checks.warm_micro_calculator``), so that it writes tool calls: each call, well
formed or not, makes the environment answer and the trajectory take another turn.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.staleflow.runtime.driver.launch_checks import check_run, warm_micro_calculator

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1800)]

ETA, STEPS = 3, 3


def test_the_calculator_task_trains_multi_turn_trajectories_within_eta(tmp_path):
    from staleflow.config import load_config
    from staleflow.models.checkpoint import load_pretrained
    from staleflow.runtime.driver.launch import launch
    from staleflow.runtime.workers.audit_trail import read_audit
    from staleflow.runtime.workers.env_stage import turns_of

    warm_micro_calculator(tmp_path / "policy")
    cfg = load_config(
        None,
        [
            f"eta={ETA}",
            f"steps={STEPS}",
            f"run_dir={tmp_path}",
            "data.task=calculator",
            f"model.checkpoint={tmp_path / 'policy'}",
            "batch_size=2",
            "group_size=4",
            "rollout.max_response_tokens=110",  # the prompt and this fit micro's 128 positions
            "coordinator.period_s=0.05",
            "env.latency_scale_s=0.01",
            "env.latency_cap_s=0.2",
            "dashboard=false",
            "eval_problems=0",
            "recovery.audit_log=true",
        ],
    )
    result = launch(cfg)
    check_run(result, ETA, STEPS, 2 * 4)
    # the step records count the episodes: some took more than one turn, called a tool
    episodes = [r for r in result.records if r.turns_mean is not None]
    assert episodes and max(r.turns_mean for r in episodes) > 1
    assert sum(r.tool_calls for r in episodes) > 0
    _, tok = load_pretrained(tmp_path / "policy")
    audit = read_audit(result.run_dir / "audit.jsonl")
    assert len(audit) == STEPS * 2 * 4
    multi = [a for a in audit if "mask" in a and len(turns_of(np.array(a["mask"], bool))) > 1]
    assert multi, "no trained trajectory took more than one model turn"
    for a in multi:
        tokens, mask = np.array(a["tokens"]), np.array(a["mask"], bool)
        # what is masked is exactly the environment's answers, between model turns
        observed = tok.decode(tokens[~mask])
        assert observed.startswith("<tool_response>") and observed.endswith("</tool_response>")
        spans = turns_of(mask)
        assert spans[0][0] == 0 and not mask[spans[0][1]]
        # the bound covers every turn: no token older than the trajectory's V_traj
        assert min(a["versions"]) >= a["v_traj"]
    # KV reuse across turns (docs/agentic.md): where a next turn came back to its instance
    # before that instance's next Pull; reported, not required (routing decides it)
    print("KV reuse:", {k: v for k, v in result.records[-1].extra.items() if "prefix" in k})
