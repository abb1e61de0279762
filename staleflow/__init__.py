"""StaleFlow: asynchronous RL post-training with a strict per-trajectory staleness bound."""

__version__ = "0.1.0"
