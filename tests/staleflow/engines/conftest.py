"""Tiny randomly initialised causal LMs for the engine tests (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.tiny_models import VOCAB, build_model  # noqa: E402

__all__ = ["VOCAB", "build_model"]


@pytest.fixture
def make_model() -> Callable[..., torch.nn.Module]:
    return build_model
