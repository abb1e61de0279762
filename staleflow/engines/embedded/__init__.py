"""The embedded CPU rollout engine (needs the ``torch`` extra: torch and transformers)."""

from staleflow.engines.embedded.config import EmbeddedEngineConfig
from staleflow.engines.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine", "EmbeddedEngineConfig"]
