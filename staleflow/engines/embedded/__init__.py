"""The embedded CPU rollout engine (needs torch and transformers, part of the default install)."""

from staleflow.engines.embedded.config import EmbeddedEngineConfig
from staleflow.engines.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine", "EmbeddedEngineConfig"]
