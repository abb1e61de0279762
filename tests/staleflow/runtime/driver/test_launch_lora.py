"""A real launch with ``trainer.lora`` on (Ray actors, the embedded engine and trainer,
micro model): the bound holds and the audit balances as without LoRA, the PS versions
are the adapter alone, the final checkpoint holds the merged policy, the adapter folder
and the base, and ``--resume`` goes on from the run checkpoint's version. (That the
resumed adapter is the checkpoint's, exactly, is checked in process:
tests/staleflow/trainers/test_trainers_lora.py.)"""

from __future__ import annotations

import json

import pytest

from tests.staleflow.runtime.driver.launch_checks import MICRO_RUN, check_run

pytest.importorskip("peft")

# 150 s here (each actor imports peft): over the default suite's budget for a launch
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 3


def test_launch_with_lora_bounded_and_conserving(tmp_path):
    from parameter_server import Layout
    from staleflow.config import load_config
    from staleflow.models.lora import load_adapter
    from staleflow.runtime.driver.launch import launch

    cfg = load_config(
        None,
        [
            "eta=1",
            f"steps={STEPS}",
            f"run_dir={tmp_path}",
            *MICRO_RUN,
            "dashboard=false",
            "eval_problems=0",
            "trainer.lora.enabled=true",
            "trainer.lora.rank=4",
            "checkpoint_every=2",
        ],
    )
    result = launch(cfg)
    check_run(result, 1, STEPS, 2 * 4)
    final = result.run_dir / "checkpoint"
    adapter = load_adapter(final / "adapter")
    assert adapter and all(".lora_" in name for name in adapter)
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert (final / "base" / "model.safetensors").is_file()
    # the PS's versions were the adapter: its layout is what every Push and Pull moved
    pushed = Layout.from_arrays({k: v.numpy() for k, v in adapter.items()})
    assert result.summary.audit["ps_latest"] == {"ps/0": STEPS}
    assert pushed.nbytes < (final / "base" / "model.safetensors").stat().st_size

    from staleflow.runtime.driver.resume import check_resume

    resumed_cfg, ck = check_resume(result.run_dir, [f"steps={STEPS + 2}"])
    assert ck.version == STEPS and (ck.trainer_dir / "adapter").is_dir()
    second = launch(resumed_cfg, resume=ck)
    assert [s["version"] for s in second.consumed] == [STEPS, STEPS + 1]
    assert second.summary.audit["ps_latest"] == {"ps/0": STEPS + 2}
    for step in second.consumed:
        assert max(step["staleness"]) <= 1
