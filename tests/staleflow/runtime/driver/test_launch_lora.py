"""A real launch with ``trainer.lora`` on (Ray actors, the embedded engine and trainer,
micro model): the bound holds and the audit balances as without LoRA, the PS versions
are the adapter alone, and the final checkpoint holds the merged policy, the adapter
folder and the base."""

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
    assert result.summary["audit"]["ps_latest"] == {"ps/0": STEPS}
    assert pushed.nbytes < (final / "base" / "model.safetensors").stat().st_size
