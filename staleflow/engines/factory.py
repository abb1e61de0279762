"""Building a vLLM or SGLang engine for one rollout instance, from plain picklable data.

``launch`` resolves each backend's options into a dict (:func:`engine_options`, in the
driver: the model folder, the run folder for logs), ships it inside the rollout spec, and
each instance's actor calls :func:`build_engine` with it. The embedded engine is built by
``staleflow.runtime.components``; this module imports no engine until it builds one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from staleflow.engines.settings import EngineSettings

ENGINE_MODEL_DIR = "engine_model"  # the built-in policy, saved for the engines to load


def engine_options(
    rollout: Any, *, checkpoint: str, run_dir: Path, model: Any = None, tokenizer: Any = None
) -> dict[str, Any]:
    """``rollout.<backend>`` as a dict, with ``model_path`` resolved (the backend's own
    setting, else ``model.checkpoint``, else ``model`` saved under the run folder) and
    ``log_dir`` set to the run folder."""
    options = dataclasses.asdict(getattr(rollout, rollout.backend))
    if not options.get("model_path"):
        if checkpoint:
            options["model_path"] = str(checkpoint)
        else:
            from staleflow.models.checkpoint import save_pretrained

            folder = Path(run_dir) / ENGINE_MODEL_DIR
            save_pretrained(model, tokenizer, folder)
            options["model_path"] = str(folder)
    options["log_dir"] = str(run_dir)
    return options


def build_engine(
    backend: str,
    settings: EngineSettings,
    options: dict[str, Any],
    *,
    inst: int,
    ps_endpoint: Any = None,
    transport: str = "auto",
    layout: dict[str, Any] | None = None,
) -> Any:
    """A started engine of ``backend`` (``vllm`` or ``sglang``) for instance ``inst``."""
    common = {f.name: getattr(settings, f.name) for f in dataclasses.fields(EngineSettings)}
    if backend == "vllm":
        from staleflow.engines.vllm import VLLMEngine, VLLMEngineConfig

        return VLLMEngine(
            VLLMEngineConfig(
                **common,
                model_path=options["model_path"],
                tensor_parallel_size=options["tensor_parallel_size"],
                gpu_memory_utilization=options["gpu_memory_utilization"],
                dtype=options["dtype"],
                extra_args=json.loads(options["extra_args"] or "{}"),
            )
        )
    if backend == "sglang":
        from staleflow.engines.sglang import (
            ParameterServerSource,
            ServerSpec,
            SGLangEngineConfig,
            start_sglang_engine,
        )

        config = SGLangEngineConfig(
            **common,
            model_path=options["model_path"],
            tp_size=options["tp_size"],
            weight_sync=options["weight_sync"],
            disk_dir=options["disk_dir"],
        )
        spec = ServerSpec(
            model_path=options["model_path"],
            log_path=str(Path(options["log_dir"]) / "sglang" / f"instance-{inst}.log"),
            tp_size=options["tp_size"],
            mem_fraction_static=options["mem_fraction_static"] or None,
            python=options["python"],
            extra_args=options["extra_server_args"],
            startup_timeout_s=options["startup_timeout_s"],
        )
        source = None
        if ps_endpoint is not None and layout is not None:
            source = ParameterServerSource(dataclasses.asdict(ps_endpoint), transport, layout)
        return start_sglang_engine(spec, config, parameter_server=source)
    raise ValueError(f"build_engine builds vllm or sglang engines, not {backend!r}")
