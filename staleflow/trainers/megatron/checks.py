"""Checks of ``trainer.backend=megatron`` against the model and the machine, run by
``staleflow launch`` before any actor starts. Each failure names the key and the fix.
Importing this module imports neither torch nor megatron-core."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from parameter_server.convert_megatron import unsupported_hf
from staleflow.config.sections import ModelConfig, TrainerConfig


class TrainerSetupError(ValueError):
    """``trainer.*`` settings this model or cluster cannot run; the message says why."""


def check_installed() -> None:
    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        raise TrainerSetupError(
            "trainer.backend=megatron needs megatron-core, which is not installed: "
            "pip install 'staleflow[megatron]' (or use trainer.backend=embedded)"
        )


def check_policy(section: TrainerConfig, hf: Mapping[str, Any], model: ModelConfig) -> None:
    """Everything about the run's policy (its HF config ``hf``, from the ``model``
    section): :func:`check_model` and :func:`check_checkpoint`."""
    check_model(section, hf, model.checkpoint or f"<built-in {model.preset}>")
    check_checkpoint(section, hf, model.checkpoint)


def check_model(section: TrainerConfig, hf: Mapping[str, Any], source: str) -> None:
    """The policy (HF ``config.json`` as a dict, read from ``source``) must have a
    Megatron layout that ``trainer.tp`` can split."""
    why = unsupported_hf(hf)
    if why:
        raise TrainerSetupError(
            f"model.checkpoint={source!r} cannot be trained with trainer.backend=megatron: "
            f"{why}; use a Llama, Qwen2 or Qwen3 checkpoint, or trainer.backend=embedded"
        )
    tp = section.tp
    heads = int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    ffn = int(hf["intermediate_size"])
    if heads % tp or kv % tp or ffn % tp:
        fits = [t for t in range(1, kv + 1) if heads % t == 0 and kv % t == 0 and ffn % t == 0]
        raise TrainerSetupError(
            f"trainer.tp={tp} does not divide the model's {heads} attention heads, {kv} KV "
            f"heads and MLP width {ffn}: use trainer.tp in {fits}"
        )


def check_checkpoint(section: TrainerConfig, hf: Mapping[str, Any], policy: str = "") -> None:
    """``trainer.load`` must be a distributed checkpoint of this very model, and the run
    must start from the same weights (``model.checkpoint``, the ``policy`` folder: the HF
    folder written beside it), which rollout serves as version 0."""
    if not section.load:
        return
    if not policy:
        raise TrainerSetupError(
            f"trainer.load={section.load!r} restores the trainer, but the rollout instances "
            "start from model.checkpoint: set model.checkpoint to the HF folder written "
            "beside it (<run>/checkpoint)"
        )
    from pathlib import Path

    from staleflow.trainers.megatron.checkpoint import CheckpointMismatch, check_architecture

    path = Path(section.load)
    if not (path / "common.pt").is_file():
        raise TrainerSetupError(
            f"trainer.load={section.load!r} is not a Megatron distributed checkpoint (no "
            "common.pt): point it at <run>/checkpoint/megatron"
        )
    from staleflow.trainers.megatron.checkpoint import read_meta

    try:
        check_architecture(read_meta(path)["hf_config"], hf, f"trainer.load={section.load!r}")
    except CheckpointMismatch as exc:
        raise TrainerSetupError(str(exc)) from None


def check_gpus(section: TrainerConfig, available: float) -> None:
    """The cluster must have the GPUs the ranks reserve."""
    need = section.gpus_per_rank * section.dp * section.tp * section.pp
    if need > available:
        raise TrainerSetupError(
            f"trainer.gpus_per_rank={section.gpus_per_rank} x {section.dp * section.tp * section.pp}"
            f" ranks needs {need} GPUs but the Ray cluster has {available:g}: lower trainer.dp "
            "or trainer.tp, or add GPU nodes"
        )
