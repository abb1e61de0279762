"""The backend registry: lazy imports and clear errors for what is not there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from staleflow.engines import BACKENDS, engine_class


def test_importing_staleflow_imports_no_engine() -> None:
    code = (
        "import sys, staleflow, staleflow.engines, staleflow.config;"
        "bad = [m for m in ('torch', 'vllm', 'sglang') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_embedded_backend_resolves_lazily() -> None:
    pytest.importorskip("torch")
    from staleflow.engines.embedded import EmbeddedEngine

    assert BACKENDS["embedded"] == "staleflow.engines.embedded:EmbeddedEngine"
    assert engine_class("embedded") is EmbeddedEngine


def test_sglang_adapter_resolves_without_sglang_installed() -> None:
    pytest.importorskip("torch")
    from staleflow.engines.sglang import SGLangEngine

    assert engine_class("sglang") is SGLangEngine
    assert "sglang" not in sys.modules


def test_vllm_adapter_imports_vllm_only_when_an_engine_starts() -> None:
    pytest.importorskip("torch")
    code = (
        "import sys; from staleflow.engines import engine_class; engine_class('vllm');"
        "assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="embedded"):
        engine_class("tgi")


def test_the_lora_backends_of_the_config_are_the_engines_that_load_adapters() -> None:
    """``trainer.lora`` refuses a rollout backend at start by LORA_ROLLOUT_BACKENDS (the
    configuration imports no engine); each engine class says it with ``loads_adapters``."""
    pytest.importorskip("torch")
    from staleflow.config.rollout import LORA_ROLLOUT_BACKENDS

    loads = {name for name in BACKENDS if getattr(engine_class(name), "loads_adapters", False)}
    assert loads == set(LORA_ROLLOUT_BACKENDS)
