"""``launch`` refuses a vLLM/SGLang setting that cannot work, before anything starts, with a
message naming the key and the fix (staleflow.engines.preflight). No engine is started."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import pytest

from staleflow.config import RunConfig, load_config
from staleflow.engines import preflight
from staleflow.engines.preflight import BackendSettingError, check_rollout_backend
from staleflow.runtime.driver.launch import LaunchError, launch


@pytest.fixture
def with_vllm(monkeypatch):
    """Pretend vLLM is importable (the checks below come after that one)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        preflight.importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "vllm" else real(name, *a),
    )


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def _check_rollout(cfg: RunConfig, *, gpus: int) -> None:
    """The check with the sections ``check_backends`` hands it."""
    check_rollout_backend(cfg.rollout, cfg.model, address=cfg.address, gpus=gpus)


def _checkpoint(tmp_path: Path, head_dim: int = 64) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(
        f'{{"hidden_size": {head_dim * 2}, "num_attention_heads": 2}}', encoding="utf-8"
    )
    return folder


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_not_installed_stops_launch_before_the_run_folder(tmp_path):
    cfg = _cfg("rollout.backend=vllm", f"run_dir={tmp_path}")
    with pytest.raises(LaunchError, match=r"rollout.backend=vllm needs vLLM .*pip install vllm"):
        launch(cfg)
    assert not any(tmp_path.iterdir())


def test_vllm_tensor_parallel_beyond_the_gpus_names_the_key(with_vllm):
    with pytest.raises(BackendSettingError, match=r"rollout.tensor_parallel=2 .* no GPU: use 1"):
        _check_rollout(_cfg("rollout.backend=vllm", "rollout.tensor_parallel=2"), gpus=0)
    with pytest.raises(
        BackendSettingError, match=r"rollout.tensor_parallel=4 .* 2 GPU\(s\): use at most 2"
    ):
        _check_rollout(_cfg("rollout.backend=vllm", "rollout.tensor_parallel=4"), gpus=2)


def test_vllm_on_cpu_refuses_heads_its_kernels_lack(with_vllm, tmp_path):
    with pytest.raises(
        BackendSettingError, match=r"head size .* this model's is 16: use model.preset=tiny"
    ):
        _check_rollout(_cfg("rollout.backend=vllm", "model.preset=micro"), gpus=0)
    _check_rollout(_cfg("rollout.backend=vllm", "model.preset=tiny"), gpus=0)
    folder = _checkpoint(tmp_path, head_dim=64)
    _check_rollout(_cfg("rollout.backend=vllm", f"rollout.vllm.model_path={folder}"), gpus=0)


def test_a_missing_model_folder_names_the_key(with_vllm, tmp_path):
    absent = tmp_path / "absent"
    with pytest.raises(
        BackendSettingError, match=rf"rollout.vllm.model_path={absent} is not a Hugging"
    ):
        _check_rollout(_cfg("rollout.backend=vllm", f"rollout.vllm.model_path={absent}"), gpus=0)
    with pytest.raises(BackendSettingError, match=rf"model.checkpoint={absent} is not a Hugging"):
        _check_rollout(_cfg("rollout.backend=sglang", f"model.checkpoint={absent}"), gpus=1)


def test_sglang_not_installed_names_the_interpreter_and_the_key(tmp_path):
    cfg = _cfg("rollout.backend=sglang", f"rollout.sglang.python={tmp_path / 'nopython'}")
    with pytest.raises(
        BackendSettingError, match=r"sglang is not installed for .*nopython.*rollout.sglang.python"
    ):
        _check_rollout(cfg, gpus=1)


def test_sglang_needs_gpus_and_enough_of_them(tmp_path):
    python = tmp_path / "python-with-sglang"
    # "finds" any module but sgl_kernel (the kernel package's CPU build)
    python.write_text('#!/bin/sh\ncase "$*" in *sgl_kernel*) exit 1;; esac\nexit 0\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    base = ("rollout.backend=sglang", f"rollout.sglang.python={python}")
    with pytest.raises(
        BackendSettingError, match=r"needs GPUs .* nor a CPU build .*sgl_kernel.* use rollout"
    ):
        _check_rollout(_cfg(*base), gpus=0)
    # with a CPU build of sgl_kernel (CI's SGLang stage) it may run on CPU
    cpu_python = tmp_path / "python-with-sglang-cpu"
    cpu_python.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    cpu_python.chmod(cpu_python.stat().st_mode | stat.S_IEXEC)
    _check_rollout(_cfg("rollout.backend=sglang", f"rollout.sglang.python={cpu_python}"), gpus=0)
    with pytest.raises(
        BackendSettingError, match=r"rollout.sglang.tp_size=4 but this machine has 2"
    ):
        _check_rollout(_cfg(*base, "rollout.sglang.tp_size=4"), gpus=2)
    _check_rollout(_cfg(*base, "rollout.sglang.tp_size=2"), gpus=2)
