"""The backend registry: lazy imports and clear errors for what is not there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from staleflow.engines import BACKENDS, engine_class


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, staleflow.engines; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_embedded_backend_resolves_lazily() -> None:
    pytest.importorskip("torch")
    from staleflow.engines.embedded import EmbeddedEngine

    assert BACKENDS["embedded"] == "staleflow.engines.embedded:EmbeddedEngine"
    assert engine_class("embedded") is EmbeddedEngine


def test_sglang_is_reserved_with_a_hint() -> None:
    with pytest.raises(NotImplementedError, match=r"sglang extra.*not implemented yet"):
        engine_class("sglang")


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="embedded"):
        engine_class("vllm")
