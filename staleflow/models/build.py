"""Building the Qwen2-architecture policies from a preset, and the built-in task's tokenizer."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from staleflow.data.synthetic import ALPHABET
from staleflow.data.tokenizer import CharTokenizer
from staleflow.models.presets import ModelPreset, get_preset

if TYPE_CHECKING:
    from transformers import Qwen2Config, Qwen2ForCausalLM

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def arithmetic_tokenizer() -> CharTokenizer:
    """The tokenizer of the built-in arithmetic task: one id per character of
    :data:`staleflow.data.synthetic.ALPHABET`, after pad, bos and eos (17 ids)."""
    return CharTokenizer(ALPHABET)


def qwen2_config(
    preset: str | ModelPreset,
    vocab_size: int,
    *,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    attn_implementation: str = "sdpa",
) -> Qwen2Config:
    """The ``transformers.Qwen2Config`` of a preset for a vocabulary of ``vocab_size``."""
    from transformers import Qwen2Config

    p = get_preset(preset) if isinstance(preset, str) else preset
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size}; it must be at least 1")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={attn_implementation!r}; use one of {ATTN_IMPLEMENTATIONS}"
        )
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        rms_norm_eps=p.rms_norm_eps,
        initializer_range=p.initializer_range,
        tie_word_embeddings=p.tie_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        dtype="float32",
    )
    config._attn_implementation = attn_implementation
    return config


def build_model(
    preset_or_config: str | ModelPreset | Qwen2Config,
    vocab_size: int | None = None,
    *,
    seed: int = 0,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    attn_implementation: str = "sdpa",
) -> Qwen2ForCausalLM:
    """A freshly initialised float32 ``Qwen2ForCausalLM`` on the CPU.

    ``preset_or_config``: a preset name (``"tiny"``, ``"micro"``), a :class:`ModelPreset`,
    or a ready ``Qwen2Config`` (then ``vocab_size``, if given, must match it). The weights
    depend only on the architecture and ``seed``: the global torch RNG is left as it was.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if isinstance(preset_or_config, Qwen2Config):
        config = preset_or_config
        if vocab_size is not None and vocab_size != config.vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} but the given config has {config.vocab_size}"
            )
    else:
        if vocab_size is None:
            raise ValueError("build_model needs vocab_size with a preset (tokenizer.vocab_size)")
        config = qwen2_config(
            preset_or_config,
            vocab_size,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            attn_implementation=attn_implementation,
        )
    # a private RNG scope, so building a model does not shift the caller's random streams
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(dtype=torch.float32)
    logger.debug(
        "built a Qwen2 model: %d parameters, vocab %d",
        sum(p.numel() for p in model.parameters()),
        config.vocab_size,
    )
    return model


def build_arithmetic_model(
    preset: str | ModelPreset = "tiny", *, seed: int = 0, attn_implementation: str = "sdpa"
) -> tuple[Qwen2ForCausalLM, CharTokenizer]:
    """An untrained policy for the built-in task with its tokenizer."""
    tokenizer = arithmetic_tokenizer()
    model = build_model(
        preset,
        tokenizer.vocab_size,
        seed=seed,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        attn_implementation=attn_implementation,
    )
    return model, tokenizer
