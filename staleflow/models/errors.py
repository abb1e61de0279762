"""Errors of the model helpers; importable without torch."""

from __future__ import annotations


class ModelError(ValueError):
    """A checkpoint that cannot be loaded, or weights that do not fit a model."""
