"""What an engine needs to know of a Hugging Face checkpoint folder without loading it:
vocabulary, KV bytes per token, and the names and shapes of its weights (read from the
safetensors headers), which are the names the parameter server carries."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    vocab_size: int
    kv_bytes_per_token: int  # K and V of every layer, at 4 bytes an element (an upper bound)
    shapes: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype name)


def read_checkpoint(path: str | Path) -> CheckpointInfo:
    """Raise ``ValueError`` naming the folder and the fix when it is not a usable checkpoint."""
    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{folder}: cannot read config.json ({exc}); give a Hugging Face checkpoint folder"
        ) from exc
    config = config.get("text_config", config)
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{folder}/config.json lacks a decoder field ({exc})") from exc
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} has no *.safetensors weights: save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        for name, (shape, dtype) in _header(file).items():
            shapes[name] = (shape, dtype)
    return CheckpointInfo(vocab, 2 * layers * kv_heads * head_dim * 4, shapes)


def _header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    # safetensors format: an 8-byte little-endian header length, then a JSON header
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        out[name] = (
            tuple(int(n) for n in spec["shape"]),
            _DTYPES.get(spec["dtype"], spec["dtype"]),
        )
    return out
