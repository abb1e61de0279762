"""Checkpoints of a Megatron pool: Megatron's distributed checkpoint, and an HF folder.

The distributed checkpoint (``megatron.core.dist_checkpointing``, PyTorch's distributed
format) stores every tensor as a global tensor cut into the writers' shards: a pool of
another TP size reads back the parts it needs. It holds the weights, the optimizer state
(AdamW's moments sharded like their parameters on CPU; Megatron's optimizer's own sharded
state on GPU), the policy version and the HF config the model was built from, which is
checked on load so that a checkpoint of another model is refused by name.

The HF folder (``config.json``, ``model.safetensors`` and the tokenizer) is what rollout
engines and ``staleflow launch model.checkpoint=<it>`` load.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from parameter_server.torch_compat import from_numpy
from staleflow.config.loss import SHAPE_KEYS  # the HF config keys that fix the weights' shapes

if TYPE_CHECKING:
    from staleflow.trainers.megatron.rank import MegatronRank

logger = logging.getLogger(__name__)

# the reference's tensors in the checkpoint: its own names, apart from the policy's
REFERENCE_PREFIX = "reference."


class CheckpointMismatch(ValueError):
    """A distributed checkpoint of another model than the one being trained."""


def architecture(hf: Mapping[str, Any]) -> dict[str, Any]:
    return {k: hf.get(k) for k in SHAPE_KEYS}


def check_architecture(saved: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Raise :class:`CheckpointMismatch` naming the first shape key that differs."""
    a, b = architecture(saved), architecture(current)
    differ = [k for k in SHAPE_KEYS if a[k] != b[k]]
    if differ:
        detail = ", ".join(f"{k} {a[k]!r} (checkpoint) vs {b[k]!r} (model)" for k in differ[:3])
        raise CheckpointMismatch(
            f"{where} holds another model: {detail}; point it at a checkpoint of the model "
            "being trained, or train the checkpoint's own model (model.checkpoint)"
        )


def read_meta(path: str | Path) -> dict[str, Any]:
    """The version and HF config stored with a distributed checkpoint (no tensors read)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(path))
    return dict(common["staleflow"])


def _optimizer_state(rank: MegatronRank, model_sd: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    update = rank.update
    if not rank.cpu:
        return update.optimizer.sharded_state_dict(model_sd)
    optimizer = update.optimizer
    for p in update.params:  # AdamW creates its moments lazily: make them exist
        state = optimizer.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    sd = optimizer.state_dict()
    steps = {float(s["step"]) for s in sd["state"].values()}
    id_map = get_param_id_to_sharded_param_map(model_sd, update.params)
    optim_state_to_sharding_state(sd, id_map, exclude_keys=("step",))
    sd["adam_step"] = max(steps) if steps else 0.0
    return sd


def save_checkpoint(rank: MegatronRank, path: str | Path) -> None:
    """Every rank of the pool calls this: a distributed checkpoint in folder ``path``."""
    from megatron.core import dist_checkpointing

    out = Path(path)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    rank.init_reference()  # before the first step: the reference is the policy now
    model_sd = rank.model.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": _optimizer_state(rank, model_sd),
        "staleflow": {
            "version": rank.version,
            "hf_config": rank.spec.hf_config,
            "tp": rank.spec.section.tp,
            "pp": rank.spec.section.pp,
            "reference": rank.reference_model is not None,
        },
    }
    if rank.reference_model is not None:
        state["reference"] = rank.reference_model.sharded_state_dict(prefix=REFERENCE_PREFIX)
    dist_checkpointing.save(state, str(out))
    dist.barrier()
    logger.info("saved distributed checkpoint (version %d) to %s", rank.version, out)


def load_checkpoint(rank: MegatronRank, path: str | Path) -> None:
    """Every rank calls this: weights, optimizer state, version and (for a trainer with a
    KL term) the reference policy from ``path``, written at any TP and PP size by a pool
    training the same model (Megatron's sharded state dict names each layer by its global
    number)."""
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    check_architecture(meta["hf_config"], rank.spec.hf_config, f"the checkpoint {path}")
    model_sd = rank.model.sharded_state_dict()
    template = {"model": model_sd, "optimizer": _optimizer_state(rank, model_sd)}
    reference = None
    if rank.spec.section.uses_reference:
        if meta.get("reference"):
            reference = rank.new_reference_model()
            template["reference"] = reference.sharded_state_dict(prefix=REFERENCE_PREFIX)
        else:
            logger.warning(
                "the checkpoint %s holds no reference policy (written without a KL term): "
                "the KL is to the loaded policy (or trainer.ref.path)",
                path,
            )
    loaded = dist_checkpointing.load(template, str(path))
    rank.model.load_state_dict(loaded["model"], strict=False)
    if reference is not None:
        _load_exactly(reference, loaded["reference"], REFERENCE_PREFIX)
        rank.use_reference(reference)
    if rank.cpu:
        optimizer = rank.update.optimizer
        sd = loaded["optimizer"]
        step = float(sd.pop("adam_step", 0.0))
        sd["param_groups"] = optimizer.state_dict()["param_groups"]
        for state in sd["state"].values():
            state["step"] = torch.tensor(step, dtype=torch.float32)
        optimizer.load_state_dict(sd)
    else:
        rank.update.optimizer.load_state_dict(loaded["optimizer"])
    rank.version = int(meta["version"])
    logger.info(
        "loaded distributed checkpoint (version %d, written at tp=%s pp=%s) from %s",
        rank.version,
        meta.get("tp"),
        meta.get("pp", 1),
        path,
    )


def _load_exactly(model: torch.nn.Module, loaded: Mapping[str, Any], prefix: str) -> None:
    """Load ``loaded`` (a sharded state dict read under ``prefix``) into ``model``: every
    parameter must be there (only Megatron's ``_extra_state`` entries may be missing)."""
    state = {k.removeprefix(prefix): v for k, v in loaded.items()}
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise CheckpointMismatch(
            f"the checkpoint's {prefix!r} tensors do not fit the model: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}; it was written by another StaleFlow version"
        )


def export_hf(
    weights: Mapping[str, np.ndarray],
    hf_config: Mapping[str, Any],
    path: str | Path,
    *,
    dtype: str,
    save_tokenizer: Callable[[Path], None] | None = None,
) -> Path:
    """Write HF-named ``weights`` as a Hugging Face folder loadable with
    ``transformers`` (and :func:`staleflow.models.load_pretrained` with its tokenizer)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: from_numpy(np.ascontiguousarray(a), dtype).contiguous() for name, a in weights.items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(hf_config), indent=2, sort_keys=True) + "\n")
    if save_tokenizer is not None:
        save_tokenizer(out)
    return out
