"""Settings of the SGLang rollout engine (an HTTP client of one SGLang server)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from staleflow.engines.settings import EngineSettings, positive_int

WEIGHT_SYNCS = ("tensor", "disk")


@dataclass(frozen=True, slots=True)
class SGLangEngineConfig(EngineSettings):
    """:class:`~staleflow.engines.settings.EngineSettings` plus the adapter's own.

    model_path: the checkpoint folder the server was started from; the adapter reads its
        weight names, shapes and vocabulary (``config.json`` and the safetensors headers).
    tp_size: the server's tensor-parallel size (one pull ticket per rank).
    weight_sync: ``tensor``: each TP rank pulls the version from the parameter server
        through our custom weight loader (``load_version``); ``disk``: weights handed to
        ``load_weights`` are written to ``disk_dir`` and loaded with
        ``/update_weights_from_disk``. ``load_weights`` always takes the disk path.
    disk_dir: a RAM-backed folder for the disk path (``/dev/shm`` on Linux).
    request_timeout_s: the longest one ``/generate`` call may take.
    poll_s: how long a ``step`` waits for a call to return before giving the instance
        back (commands wait at most this long for the engine).
    lora_rank, lora_alpha, lora_targets: with ``lora_rank`` > 0 (``trainer.lora``) every
        version is a LoRA adapter of that rank, alpha and target modules, loaded with
        ``/load_lora_adapter`` from a folder under ``disk_dir``; the server must run with
        ``--enable-lora`` (``ServerSpec.lora_rank``).
    """

    model_path: str = ""
    tp_size: int = 1
    weight_sync: str = "tensor"
    disk_dir: str = "/dev/shm"
    request_timeout_s: float = 3600.0
    poll_s: float = 0.02
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        if not self.model_path or not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(
                f"model_path={self.model_path!r} is not a Hugging Face checkpoint folder (no "
                "config.json): give the folder the SGLang server was started from"
            )
        positive_int("tp_size", self.tp_size, "the server's tensor-parallel size")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync={self.weight_sync!r}: use tensor or disk")
        if not self.request_timeout_s > 0 or not self.poll_s > 0:
            raise ValueError("request_timeout_s and poll_s must be positive seconds")
        if self.lora_rank and not (self.lora_alpha > 0 and self.lora_targets):
            raise ValueError(
                "lora_rank > 0 needs lora_alpha > 0 and lora_targets (the adapter's scale is "
                "alpha / rank, over the named modules)"
            )
