"""LoRA adapters in a served engine (``trainer.lora``): what each version's adapter holds
over a checkpoint folder, and the adapter folders an engine hands its server.

vLLM and SGLang load an adapter from a PEFT folder (``adapter_model.safetensors`` and
``adapter_config.json``, :func:`staleflow.models.lora.write_adapter`); each version is a
new folder under one root, deleted once the engine has moved every request to the next.
The engine-specific part (vLLM's ``LoRARequest``, SGLang's ``/load_lora_adapter``) is in
``staleflow.engines.vllm.lora`` and ``staleflow.engines.sglang.engine``.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staleflow.engines.checkpoint import CheckpointInfo
from staleflow.models.lora import ADAPTER_PREFIX, adapter_config, write_adapter


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """The adapter every version carries: rank, alpha and target module names."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def shapes(self, checkpoint: CheckpointInfo) -> dict[str, tuple[tuple[int, ...], str]]:
        """Adapter-file name -> (shape, dtype) of every adapter matrix over ``checkpoint``:
        ``A`` (rank x in) and ``B`` (out x rank) of each target linear layer."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, (shape, dtype) in checkpoint.shapes.items():
            module, _, leaf = name.rpartition(".")
            if leaf != "weight" or len(shape) != 2 or module.rpartition(".")[2] not in self.targets:
                continue
            rows, cols = shape
            out[f"{ADAPTER_PREFIX}{module}.lora_A.weight"] = ((self.rank, cols), dtype)
            out[f"{ADAPTER_PREFIX}{module}.lora_B.weight"] = ((rows, self.rank), dtype)
        if not out:
            raise ValueError(
                f"no linear layer of the model is named {', '.join(self.targets)}: set "
                "trainer.lora.target_modules to layers the model has"
            )
        return out


class AdapterFolders:
    """The adapter folders of one engine, under ``root`` (empty: a temporary folder)."""

    def __init__(self, spec: AdapterSpec, root: str = "") -> None:
        self.spec = spec
        self.root = Path(root or tempfile.mkdtemp(prefix="staleflow-lora-"))
        self._ids = itertools.count(1)

    def write(self, tensors: dict[str, Any], version: int) -> tuple[str, int, Path]:
        """Write a version's adapter; returns (a name unique in this engine, its id, folder)."""
        lora_id = next(self._ids)
        name = f"v{version}-{lora_id}"
        config = adapter_config(self.spec.rank, self.spec.alpha, self.spec.targets)
        return name, lora_id, write_adapter(tensors, config, self.root / name)

    def remove(self, folder: str | Path) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
