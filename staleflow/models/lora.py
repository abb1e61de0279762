"""LoRA adapters on a ``transformers`` causal LM (``trainer.lora``), through ``peft``.

A policy with adapters is the model with peft's LoRA layers injected in place
(:func:`add_adapters`): each target ``nn.Linear`` becomes a layer that computes
``base(x) + (alpha / r) * B(A(dropout(x)))``, so the embedded trainer and the embedded
engine drive it exactly as they drive the model without adapters.

Its weights split in two, each under the names other tools use:

* the **base** (:func:`base_state`): the frozen weights, under the model's own
  ``named_parameters()`` names without adapters (``model.layers.0.self_attn.q_proj.weight``),
  the names of the policy without LoRA, of a Hugging Face checkpoint and of vLLM / SGLang;
* the **adapter** (:func:`adapter_state`): the trained ``lora_A`` / ``lora_B`` matrices, under
  the names of a PEFT adapter file (``base_model.model.<module>.lora_A.weight``), which
  ``peft``, vLLM and SGLang load from an adapter folder (:func:`save_adapter`).

The parameter server carries the base once and the adapter every version; the checkpoint
keeps both (``staleflow.trainers.embedded``). ``peft`` is the optional extra ``lora``; it
is imported only where adapters are built, and torch only where a function needs it, so
that the driver's and the SGLang adapter's modules import this one at module level.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.install import missing
from staleflow.models.errors import ModelError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from staleflow.config.lora import LoraConfig

ADAPTER_PREFIX = "base_model.model."  # how a PEFT adapter file names each tensor
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_ADAPTER = "default"  # peft's name of the one adapter a policy has
_BASE_LAYER = ".base_layer."  # where peft moves a wrapped layer's own weights
_LORA_PARTS = (".lora_A.", ".lora_B.")


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError("trainer.lora: " + missing("peft", exc, "lora")) from exc
    return peft


def peft_config(lora: LoraConfig) -> Any:
    """``lora`` as a ``peft.LoraConfig`` (a causal LM's, no bias training)."""
    return _peft().LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )


# -- building ---------------------------------------------------------------------------


def linear_names(model: nn.Module) -> set[str]:
    """The last part of every ``nn.Linear`` module's path (what target modules name)."""
    from torch import nn

    return {
        name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)
    }


def check_targets(model: nn.Module, lora: LoraConfig) -> None:
    """Refuse target modules that name no linear layer of ``model``, naming the ones it has."""
    have = linear_names(model)
    missing = [t for t in lora.targets if t not in have]
    if missing:
        raise ModelError(
            f"trainer.lora.target_modules={lora.target_modules!r}: {type(model).__name__} "
            f"has no linear layer named {', '.join(missing)}; its linear layers are "
            f"{','.join(sorted(have))}: set trainer.lora.target_modules to some of them"
        )


def has_adapters(model: nn.Module) -> bool:
    return any(_is_adapter(name) for name, _ in model.named_parameters())


def add_adapters(model: nn.Module, lora: LoraConfig, *, seed: int = 0) -> nn.Module:
    """Inject LoRA layers into ``model`` in place (``A`` drawn from ``seed``, ``B`` zero:
    the policy is unchanged until it trains); every other weight is frozen."""
    import torch

    check_targets(model, lora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _peft().inject_adapter_in_model(peft_config(lora), model, adapter_name=_ADAPTER)
    dtype = next(p.dtype for n, p in model.named_parameters() if not _is_adapter(n))
    for name, p in model.named_parameters():
        if _is_adapter(name):
            p.data = p.data.to(dtype)
        p.requires_grad_(_is_adapter(name))
    return model


def dropout_modules(model: nn.Module) -> list[nn.Module]:
    """The adapters' input dropouts (``nn.Dropout``; ``nn.Identity`` at dropout 0)."""
    from torch import nn

    return [
        m
        for name, m in model.named_modules()
        if name.endswith(f"lora_dropout.{_ADAPTER}") and isinstance(m, nn.Dropout)
    ]


# -- names and weights ------------------------------------------------------------------


def _is_adapter(name: str) -> bool:
    return any(part in name for part in _LORA_PARTS)


def adapter_key(param: str) -> str:
    """The adapter-file name of an injected adapter parameter."""
    return ADAPTER_PREFIX + param.replace(f".{_ADAPTER}.", ".")


def base_key(param: str) -> str:
    """The name a base parameter has in the model without adapters."""
    return param.replace(_BASE_LAYER, ".")


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter's live parameters by adapter-file name."""
    return {adapter_key(n): p for n, p in model.named_parameters() if _is_adapter(n)}


def base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base's live parameters by the names of the model without adapters."""
    return {base_key(n): p for n, p in model.named_parameters() if not _is_adapter(n)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's matrices by adapter-file name (detached views of the live weights)."""
    return {k: p.detach() for k, p in adapter_parameters(model).items()}


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen weights by the names of the model without adapters (tied ones once)."""
    return {k: p.detach() for k, p in base_parameters(model).items()}


def load_adapter_state(model: nn.Module, state: Mapping[str, object]) -> None:
    """Copy an adapter (by adapter-file name) into ``model``; every name and shape is
    checked first, so a mismatch (``ModelError``) leaves it unchanged."""
    _load(adapter_parameters(model), state)


def load_base_state(model: nn.Module, state: Mapping[str, object]) -> None:
    """Copy base weights (by the names of the model without adapters) into ``model``."""
    _load(base_parameters(model), state)


def _load(params: Mapping[str, nn.Parameter], state: Mapping[str, object]) -> None:
    # torch: staleflow.models.state loads it, and this module leaves it to the caller
    from staleflow.models.state import load_parameters

    load_parameters(params, state)


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights with every adapter folded in (``W + (alpha / r) B A``), by the
    names of the model without adapters: what a model without LoRA computes the same with."""
    from torch import nn

    out = {k: v.clone() for k, v in base_state(model).items()}
    for name, m in model.named_modules():
        lora_a = getattr(m, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or _ADAPTER not in lora_a:
            continue
        a = lora_a[_ADAPTER].weight.detach()
        b = m.lora_B[_ADAPTER].weight.detach()  # type: ignore[union-attr,index]
        scale = float(m.scaling[_ADAPTER])  # type: ignore[union-attr,index]
        out[f"{name}.weight"] += (b.float() @ a.float() * scale).to(out[f"{name}.weight"].dtype)
    return out


# -- files -------------------------------------------------------------------------------


def adapter_config(
    rank: int,
    alpha: float,
    targets: tuple[str, ...] | list[str],
    dropout: float = 0.0,
    base: str = "",
) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA adapter folder (what ``peft``, vLLM and
    SGLang read), written without peft; ``base`` names the base model's folder."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base or None,
    }


def write_adapter(state: Mapping[str, Any], config: Mapping[str, Any], folder: str | Path) -> Path:
    """Write an adapter folder: ``state`` (tensors or arrays by adapter-file name) and its
    ``config`` (:func:`adapter_config`)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.detach() if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v)))
        .contiguous()
        .clone()
        for k, v in state.items()
    }
    save_file(tensors, out / ADAPTER_FILE)
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    return out


def save_adapter(
    state: Mapping[str, torch.Tensor], lora: LoraConfig, folder: str | Path, base: str = ""
) -> Path:
    """Write ``lora``'s adapter folder, which ``peft``, vLLM and SGLang load."""
    config = adapter_config(lora.rank, lora.alpha, lora.targets, lora.dropout, base)
    return write_adapter(state, config, folder)


def load_adapter(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an adapter folder written by :func:`save_adapter`."""
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_FILE
    if not path.is_file():
        raise ModelError(f"{folder}: not a LoRA adapter folder (no {ADAPTER_FILE})")
    return load_file(str(path))


def with_adapters(
    model: nn.Module, lora: LoraConfig, *, seed: int = 0, checkpoint: str | Path | None = None
) -> nn.Module:
    """The run's policy with adapters: fresh ones (from ``seed``) on ``model``, or, from a
    LoRA trainer ``checkpoint`` (whose merged weights ``model`` was loaded with), its exact
    base and its adapter. ``ModelError`` names the fix (a target the model lacks, a
    checkpoint written without LoRA)."""
    from safetensors.torch import load_file

    base = None
    if checkpoint is not None:
        path = Path(checkpoint) / "base" / "model.safetensors"
        if not path.is_file():
            raise ModelError(
                f"{checkpoint} is not a LoRA checkpoint (no base/model.safetensors): resume it "
                "with trainer.lora.enabled=false, or start a new LoRA run from it with "
                f"model.checkpoint={checkpoint}"
            )
        base = load_file(str(path))
    add_adapters(model, lora, seed=seed)
    if checkpoint is not None:
        load_base_state(model, base or {})
        load_adapter_state(model, load_adapter(Path(checkpoint) / "adapter"))
    return model
