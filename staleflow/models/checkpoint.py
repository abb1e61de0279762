"""Saving and loading policies as Hugging Face checkpoint directories, offline only.

A StaleFlow-built model is saved with ``save_pretrained`` (``config.json`` and
``model.safetensors``) and its character tokenizer alongside, in
:data:`CHAR_TOKENIZER_FILE`; a user's own checkpoint carries a Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from staleflow.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from staleflow.models.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

CHAR_TOKENIZER_FILE = "staleflow_tokenizer.json"
_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model*.safetensors.index.json")
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def save_pretrained(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    path: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` and ``tokenizer`` into directory ``path`` (created if needed);
    ``state_dict`` replaces the model's own weights (a LoRA policy's merged ones)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict)
    save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Write ``tokenizer`` into checkpoint directory ``path`` (next to the weights)."""
    out = Path(path)
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.save(out / CHAR_TOKENIZER_FILE)
    elif isinstance(tokenizer, HFTokenizer):
        # the adapter does not expose its wrapped tokenizer; saving needs it
        tokenizer._tok.save_pretrained(out)
    else:
        raise ModelError(f"cannot save a tokenizer of type {type(tokenizer).__name__}")


def _check_directory(p: Path) -> dict:
    if not p.exists():
        raise ModelError(f"{p}: no such checkpoint directory")
    if not p.is_dir():
        raise ModelError(f"{p}: not a directory; pass a Hugging Face checkpoint directory")
    config_file = p / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{p}: not a Hugging Face checkpoint (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{config_file}: cannot be read: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"{config_file}: has no 'model_type'; not a transformers config")
    if not any(any(p.glob(pattern)) for pattern in _WEIGHT_FILES):
        raise ModelError(
            f"{p}: has no weights (model.safetensors or pytorch_model.bin); a config alone "
            "is not a checkpoint"
        )
    return config


def _load_tokenizer(p: Path) -> Tokenizer:
    if (p / CHAR_TOKENIZER_FILE).is_file():
        return CharTokenizer.load(p / CHAR_TOKENIZER_FILE)
    if any((p / name).is_file() for name in _HF_TOKENIZER_FILES):
        try:
            return HFTokenizer(p)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{p}: cannot load its tokenizer: {exc}") from None
    raise ModelError(
        f"{p}: has no tokenizer ({CHAR_TOKENIZER_FILE}, or a Hugging Face tokenizer.json / "
        "tokenizer_config.json); save one next to the weights"
    )


def _other_tokenizer(path: str | Path) -> Tokenizer:

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer {path}: {exc}") from None


def load_pretrained(
    path: str | Path,
    *,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    tokenizer_path: str | Path | None = None,
) -> tuple[PreTrainedModel, Tokenizer]:
    """A causal LM and its tokenizer from a local checkpoint directory (never downloads).

    ``tokenizer_path`` (a Hugging Face tokenizer directory or a CharTokenizer ``.json``)
    replaces the checkpoint's own tokenizer, e.g. for a checkpoint saved without one.

    Raises :class:`ModelError` naming the problem when the directory is missing, is not
    a Hugging Face checkpoint, holds a model that is not a causal LM, or has no tokenizer,
    or when the tokenizer has more ids than the model's embedding.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    p = Path(path).expanduser()
    raw = _check_directory(p)
    try:
        config = AutoConfig.from_pretrained(
            p, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{p}: cannot read config.json: {exc}") from None
    remote_causal = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not remote_causal:
        raise ModelError(
            f"{p}: model_type={raw['model_type']!r} is not a causal language model; "
            "transformers has no causal-LM class for it"
        )
    tokenizer = _load_tokenizer(p) if tokenizer_path is None else _other_tokenizer(tokenizer_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p,
            config=config,
            local_files_only=True,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError) as exc:
        raise ModelError(f"{p}: cannot load the model: {exc}") from None
    rows = model.get_input_embeddings().weight.shape[0]
    if tokenizer.vocab_size > rows:
        raise ModelError(_ids_beyond_embedding(p, tokenizer, rows))
    logger.info("loaded %s (%s) from %s", type(model).__name__, raw["model_type"], p)
    return model, tokenizer


def _ids_beyond_embedding(p: Path, tokenizer: Tokenizer, rows: int) -> str:
    """Why the tokenizer does not fit the embedding: the ids beyond it, by name (often
    special tokens that the tokenizer's class adds: transformers loads a tokenizer whose
    tokenizer_config.json names no class by config.json's model_type, and Qwen2Tokenizer
    then adds '<|endoftext|>'), and the fix."""
    extra = list(range(rows, tokenizer.vocab_size))
    describe = getattr(tokenizer, "describe_ids", None)
    names = describe(extra[:8]) if describe is not None else [str(i) for i in extra[:8]]
    more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
    return (
        f"{p}: the tokenizer has {tokenizer.vocab_size} ids but the model's embedding only "
        f"{rows} rows; beyond it: {', '.join(names)}{more}. Use the tokenizer the model was "
        "trained with (data.tokenizer=<its folder>; a tokenizer_config.json without "
        "'tokenizer_class' is loaded by config.json's model_type, whose class may add "
        "special tokens of its own), or remove these tokens from tokenizer_config.json's "
        "added_tokens_decoder and tokenizer.json's added_tokens, or resize the model's "
        f"embedding to {tokenizer.vocab_size} rows (resize_token_embeddings) and save it"
    )
