"""Checks of ``trainer.backend=megatron`` against the model, run by ``staleflow launch``
before anything slow (:func:`check_run` is the backend's hook in
:data:`staleflow.runtime.backends.TRAINER_POOLS`: before Ray is joined, a model loaded or
the built-in one warmed up). Each failure names the key and the fix. ``trainer.ranks``
against ``dp x tp x pp`` and ``trainer.pp`` are the config's own checks
(:class:`~staleflow.config.TrainerConfig`); GPUs too few for the ranks are the placement
fit's (``resources.trainer.gpus`` per rank). Importing this module imports neither torch
nor megatron-core.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from parameter_server.convert_megatron import unsupported_hf
from staleflow.config.recovery import RecoveryConfig
from staleflow.config.sections import ModelConfig, TrainerConfig
from staleflow.install import missing
from staleflow.models.build import arithmetic_tokenizer, qwen2_config
from staleflow.trainers.megatron.checkpoint import CheckpointMismatch, check_architecture, read_meta


class TrainerSetupError(ValueError):
    """``trainer.*`` settings this model or cluster cannot run; the message says why."""


def check_installed() -> None:
    if importlib.util.find_spec("megatron") is None or (
        importlib.util.find_spec("megatron.core") is None
    ):
        raise TrainerSetupError(
            f"trainer.backend=megatron needs {missing('megatron-core', extra='megatron')} "
            "(or use trainer.backend=embedded)"
        )


def check_run(trainer: TrainerConfig, model: ModelConfig, recovery: RecoveryConfig) -> None:
    """Everything checkable from the configuration alone: megatron-core installed, no
    audit log asked of it (``recovery.audit_log``), and the policy (its HF config: ``model.checkpoint``'s ``config.json``, or the built-in
    preset's) trainable at ``trainer.tp`` (:func:`check_policy`)."""
    check_installed()
    if recovery.audit_log:  # the ranks take their batches from the TS themselves
        raise ValueError(
            "recovery.audit_log=true is written by the embedded trainer, which sees every "
            "batch; the Megatron ranks fetch theirs from the TS: set recovery.audit_log=false "
            "or trainer.backend=embedded"
        )
    hf = policy_config(model)
    if hf is not None:
        check_policy(trainer, hf, model)


def policy_config(model: ModelConfig) -> dict[str, Any] | None:
    """The policy's HF config as a dict, without loading weights: the checkpoint's, or the
    built-in preset's Qwen2 config. None when the checkpoint has no readable config (the
    launcher's own preflight names that)."""
    if not model.checkpoint:
        return qwen2_config(model.preset, arithmetic_tokenizer().vocab_size).to_dict()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model.checkpoint, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None
    return config.to_dict()


def check_policy(section: TrainerConfig, hf: Mapping[str, Any], model: ModelConfig) -> None:
    """Everything about the run's policy (its HF config ``hf``, from the ``model``
    section): :func:`check_model` and :func:`check_checkpoint`."""
    check_model(section, hf, model.checkpoint or f"<built-in {model.preset}>")
    check_checkpoint(section, hf, model.checkpoint)


def check_model(section: TrainerConfig, hf: Mapping[str, Any], source: str) -> None:
    """The policy (HF ``config.json`` as a dict, read from ``source``) must have a
    Megatron layout that ``trainer.tp`` and ``trainer.pp`` can split."""
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
    layers = int(hf["num_hidden_layers"])
    if layers % section.pp:
        fits = [p for p in range(1, layers + 1) if layers % p == 0]
        raise TrainerSetupError(
            f"trainer.pp={section.pp} does not divide the model's {layers} layers into equal "
            f"pipeline stages: use trainer.pp in {fits}"
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

    path = Path(section.load)
    if not (path / "common.pt").is_file():
        raise TrainerSetupError(
            f"trainer.load={section.load!r} is not a Megatron distributed checkpoint (no "
            "common.pt): point it at <run>/checkpoint/megatron"
        )

    try:
        check_architecture(read_meta(path)["hf_config"], hf, f"trainer.load={section.load!r}")
    except CheckpointMismatch as exc:
        raise TrainerSetupError(str(exc)) from None
