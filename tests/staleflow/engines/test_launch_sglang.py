"""``staleflow launch`` with ``rollout.backend=sglang`` end to end against real SGLang
servers (one ``sglang.launch_server`` per instance, on CPU in CI's SGLang stage,
``.ci/sglang``): real Ray actors, the servers loading the built-in policy from the run
folder and every new version through ``/update_weights_from_tensor`` and StaleFlow's
loader (each server pulls it from its node's PS), the embedded trainer.

What must hold whatever the policy learns, as for the embedded engine
(tests/staleflow/runtime/test_launch_e2e.py): every consumed group within eta, nothing lost
or consumed twice (the run's audit), the instances loading the versions the PS publishes.
"""

from __future__ import annotations

import pytest

from tests.staleflow.engines.backends import SGLANG_SKIP, sglang_available
from tests.staleflow.runtime.driver.launch_checks import check_run
from tests.staleflow.runtime.driver.test_launch_e2e import STEPS

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.ray,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not sglang_available(), reason=SGLANG_SKIP),
]


def test_launch_sglang_eta3_bounded_and_conserving(tmp_path):
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch

    cfg = load_config(
        None,
        [
            "eta=3",
            f"steps={STEPS}",
            f"run_dir={tmp_path}",
            "model.preset=tiny",
            "model.warmup=false",
            "rollout.backend=sglang",
            "rollout.instances=1",  # one server: each takes a minute or more to start on 2 cores
            "rollout.kv_budget_tokens=2048",
            "rollout.max_running=16",
            "rollout.sglang.extra_server_args=--dtype float32 --max-total-tokens 4096 --mem-fraction-static 0.05",
            "batch_size=2",
            "group_size=4",
            "rollout.max_response_tokens=8",
            "coordinator.period_s=0.05",
            "dashboard=false",
            "eval_problems=32",
        ],
    )
    result = launch(cfg)
    check_run(result, 3, STEPS, 2 * 4)  # the embedded engine's end-to-end checks
    # the servers loaded the built-in policy the launch saved into the run folder
    assert (result.run_dir / "engine_model" / "config.json").is_file()
    logs = sorted((result.run_dir / "sglang").glob("instance-*.log"))
    assert len(logs) == 1 and all("fired up" in p.read_text() for p in logs)
