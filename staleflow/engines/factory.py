"""Building a vLLM or SGLang engine for one rollout instance, from plain picklable data.

``launch`` resolves each backend's section (:func:`engine_options`, in the driver: the
model folder, the run folder for logs), ships it inside the rollout spec, and each
instance's actor calls :func:`build_engine` with it. The embedded engine is built by
``staleflow.runtime.workers.specs``; this module imports no engine until it builds one.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.config.sections import RolloutConfig, SGLangOptions, VLLMOptions
from staleflow.engines.settings import EngineSettings
from staleflow.models import lora as lora_lib

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from parameter_server.transport.base import Endpoint
    from staleflow.config.lora import LoraConfig
    from staleflow.data.tokenizer import Tokenizer

ENGINE_MODEL_DIR = "engine_model"  # the built-in policy, saved for the engines to load


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """A served backend's section with its model folder resolved, and where its logs go."""

    section: VLLMOptions | SGLangOptions  # model_path is never empty here
    log_dir: str
    tensor_parallel: int = 1  # rollout.tensor_parallel: vLLM's tensor_parallel_size


def engine_options(
    rollout: RolloutConfig,
    *,
    checkpoint: str,
    run_dir: Path,
    model: PreTrainedModel | None = None,
    tokenizer: Tokenizer | None = None,
) -> EngineOptions:
    """``rollout.<backend>`` with ``model_path`` resolved (the backend's own setting, else
    ``model.checkpoint``, else ``model`` saved under the run folder), logging into the run
    folder."""
    section: VLLMOptions | SGLangOptions = getattr(rollout, rollout.backend)
    if not section.model_path:
        if checkpoint:
            path = str(checkpoint)
        else:
            # torch: only when a built-in model must be saved for the served engine to read
            from staleflow.models.checkpoint import save_pretrained

            folder = Path(run_dir) / ENGINE_MODEL_DIR
            # a policy with LoRA adapters: the folder is the frozen base they apply to
            base = lora_lib.base_state(model) if lora_lib.has_adapters(model) else None
            save_pretrained(model, tokenizer, folder, base)
            path = str(folder)
        section = dataclasses.replace(section, model_path=path)
    return EngineOptions(
        section=section, log_dir=str(run_dir), tensor_parallel=rollout.tensor_parallel
    )


def build_engine(
    backend: str,
    settings: EngineSettings,
    options: EngineOptions,
    *,
    inst: int,
    ps_endpoint: Endpoint | None = None,
    transport: str = "auto",
    layout: dict[str, Any] | None = None,
    lora: LoraConfig | None = None,
) -> Any:
    """A started engine of ``backend`` (``vllm`` or ``sglang``) for instance ``inst``; with
    ``lora`` (``trainer.lora``), one whose versions are that adapter."""
    common = {f.name: getattr(settings, f.name) for f in dataclasses.fields(EngineSettings)}
    o = options.section
    if backend == "vllm" and isinstance(o, VLLMOptions):
        # an optional backend: vLLM (and torch) load only where a vLLM engine is built
        from staleflow.engines.vllm import VLLMEngine, VLLMEngineConfig

        return VLLMEngine(
            VLLMEngineConfig(
                **common,
                model_path=o.model_path,
                tensor_parallel_size=options.tensor_parallel,
                gpu_memory_utilization=o.gpu_memory_utilization,
                dtype=o.dtype,
                extra_args=json.loads(o.extra_args or "{}"),
                log_path=str(Path(options.log_dir) / "vllm" / f"instance-{inst}.log"),
                **_lora_settings(lora),
                lora_dir=str(Path(options.log_dir) / "vllm" / f"lora-{inst}"),
            )
        )
    if backend == "sglang" and isinstance(o, SGLangOptions):
        # an optional backend: loaded only where an SGLang engine is built
        from staleflow.engines.sglang import (
            ParameterServerSource,
            ServerSpec,
            SGLangEngineConfig,
            start_sglang_engine,
        )

        config = SGLangEngineConfig(
            **common,
            model_path=o.model_path,
            tp_size=o.tp_size,
            weight_sync=o.weight_sync,
            disk_dir=o.disk_dir,
            **_lora_settings(lora),
        )
        spec = ServerSpec(
            model_path=o.model_path,
            log_path=str(Path(options.log_dir) / "sglang" / f"instance-{inst}.log"),
            tp_size=o.tp_size,
            mem_fraction_static=o.mem_fraction_static or None,
            python=o.python,
            extra_args=o.extra_server_args,
            deterministic=o.deterministic,
            startup_timeout_s=o.startup_timeout_s,
            lora_rank=0 if lora is None else lora.rank,
            lora_targets=() if lora is None else lora.targets,
        )
        source = None
        if ps_endpoint is not None and layout is not None:
            source = ParameterServerSource(dataclasses.asdict(ps_endpoint), transport, layout)
        return start_sglang_engine(spec, config, parameter_server=source)
    raise ValueError(
        f"build_engine builds vllm or sglang engines from their own section, not {backend!r} "
        f"with {type(o).__name__}"
    )


def _lora_settings(lora: LoraConfig | None) -> dict[str, Any]:
    """A served engine's LoRA settings (``trainer.lora``); none without it."""
    if lora is None:
        return {}
    return {"lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_targets": lora.targets}
