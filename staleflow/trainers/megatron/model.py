"""A Megatron-core ``GPTModel`` built from the policy's Hugging Face config.

Llama, Qwen2 and Qwen3 decoders map onto Megatron's GPT layer with the local (non-
Transformer-Engine) spec: RMSNorm, rotary embeddings without interleaving, SwiGLU,
grouped-query attention; Qwen2 adds a QKV bias, Qwen3 per-head q/k RMSNorms. The shape
and the weight names are those of :func:`parameter_server.convert_megatron.gpt_config_from_hf`,
so the same converter moves weights both ways. Checked against ``transformers`` logits to
1e-7 at TP = 1 and 2 (tests/staleflow/trainers/test_megatron_equivalence.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from parameter_server.convert_megatron import GPTConfig, pipeline_stage
from parameter_server.torch_compat import from_numpy

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
_LAYERS = "decoder.layers."


@dataclass(frozen=True, slots=True)
class Stage:
    """The pipeline stage a rank holds: ``index`` of ``size`` equal stages of the
    ``num_layers`` decoder layers. Megatron numbers a stage's layers from 0
    (``decoder.layers.{local}``); the converter, the PS and Push name them by their
    global number; this maps one to the other."""

    index: int = 0
    size: int = 1
    num_layers: int = 1
    tied: bool = False

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    @property
    def offset(self) -> int:
        return self.index * (self.num_layers // self.size)

    @property
    def tied_copy(self) -> bool:
        """This stage's output layer is a copy of the first stage's tied embedding
        (Megatron keeps one on the last stage and sums the two gradients)."""
        return self.tied and self.last and not self.first

    def to_global(self, name: str) -> str:
        if not name.startswith(_LAYERS):
            return name
        local, rest = name[len(_LAYERS) :].split(".", 1)
        return f"{_LAYERS}{int(local) + self.offset}.{rest}"

    def holds(self, name: str) -> bool:
        """Whether global Megatron name ``name`` is one of this stage's own parameters."""
        return pipeline_stage(name, self.num_layers, self.size) == self.index


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: the Megatron trainer runs {sorted(_DTYPES)}") from None


def rope_theta(hf: Mapping[str, Any]) -> float:
    rope = hf.get("rope_parameters") or {}
    return float(rope.get("rope_theta") or hf.get("rope_theta") or 10_000.0)


def build_gpt(
    hf: Mapping[str, Any],
    gpt: GPTConfig,
    *,
    tp: int,
    dtype: str,
    cpu: bool,
    stage: Stage | None = None,
) -> GPTModel:
    """The model of this rank (its TP shard of its pipeline ``stage``'s layers),
    uninitialised: the weights are loaded next.

    ``calculate_per_token_loss`` tells Megatron's data-parallel wrapper (GPU path) to sum
    gradients over ranks instead of averaging them: the loss is already divided by the
    global token count (:func:`staleflow.trainers.rl.train_step`).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    stage = stage or Stage(num_layers=gpt.num_layers, tied=gpt.tie_word_embeddings)
    params_dtype = torch_dtype(dtype)
    config = TransformerConfig(
        num_layers=gpt.num_layers,
        hidden_size=gpt.hidden_size,
        num_attention_heads=gpt.num_attention_heads,
        num_query_groups=gpt.num_query_groups,
        ffn_hidden_size=gpt.ffn_hidden_size,
        kv_channels=gpt.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=gpt.qkv_bias,
        qk_layernorm=gpt.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=stage.size,
        # micro-batches differ in width (right-padded to their longest sequence): the
        # pipeline sends each activation's shape before it
        variable_seq_lengths=stage.size > 1,
        # no experts here; the config refuses variable lengths with the default
        # (allgather) MoE dispatcher all the same (transformer_config.py:1827)
        moe_token_dispatcher_type="alltoall",
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=cpu,
        # the weights come from the checkpoint, but Megatron marks its tensor-parallel
        # weights (partition_dim, ...) only while initialising them: the TP-aware clip
        # and the checkpoint sharding read those marks
        perform_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=gpt.qk_layernorm)
    return GPTModel(
        config,
        spec,
        vocab_size=gpt.vocab_size,
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_base=int(rope_theta(hf)),
        share_embeddings_and_output_weights=gpt.tie_word_embeddings,
        parallel_output=True,
        pre_process=stage.first,
        post_process=stage.last,
    )


def parameters_by_name(
    model: torch.nn.Module, stage: Stage | None = None
) -> dict[str, torch.nn.Parameter]:
    """The model's own parameters by global state-dict name (what the converter calls
    them); a last stage's copy of tied embeddings is left out (the first stage holds them)."""
    stage = stage or Stage()
    return {
        stage.to_global(n): p
        for n, p in model.named_parameters()
        if not (stage.tied_copy and n == OUTPUT)
    }


def load_shard(
    model: torch.nn.Module, shard: Mapping[str, Any], stage: Stage | None = None
) -> None:
    """Copy this rank's converted shard (numpy arrays or tensors by global Megatron name,
    the whole model's or the stage's) into the stage's model; every parameter must be
    given, with its shape."""

    stage = stage or Stage()
    params = parameters_by_name(model, stage)
    if stage.tied_copy:
        params[EMBEDDING] = dict(model.named_parameters())[OUTPUT]
    if stage.size > 1:
        shard = {
            n: v for n, v in shard.items() if stage.holds(n) or (stage.tied_copy and n == EMBEDDING)
        }
    missing = sorted(set(params) - set(shard))
    extra = sorted(set(shard) - set(params))
    if missing or extra:
        raise ValueError(
            f"the converted shard does not match the Megatron model: missing {missing[:3]}, "
            f"unexpected {extra[:3]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            value = shard[name]
            if not isinstance(value, torch.Tensor):
                # the PS carries bfloat16 as its uint16 bits
                value = from_numpy(value, "bfloat16" if value.dtype.name == "uint16" else "")
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)}, the model has {tuple(param.shape)}"
                )
            param.copy_(value)
