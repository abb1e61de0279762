"""Tiny randomly initialised causal LMs for tests that run a real engine (nothing is
downloaded): one builder, so that the engine, rollout and runtime tests share one shape."""

from __future__ import annotations

import torch
import transformers

VOCAB = 48


def build_model(
    kind: str = "qwen2", *, seed: int = 0, tied: bool = True, vocab: int = VOCAB
) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=vocab,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(kind)
    return model.eval()
