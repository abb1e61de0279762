"""Where a rollout or trainer backend plugs into ``staleflow launch``: one hook per name.

The engine and trainer classes live in their lazy registries
(:data:`staleflow.engines.BACKENDS`, :data:`staleflow.trainers.TRAINERS`). What ``launch``
needs besides the class is how to build it from the run's typed sections, and for a
trainer how many ranks (placement bundles) it takes. That is one entry here per backend,
named by ``rollout.backend`` / ``trainer.backend``:

- :data:`ENGINE_BUILDERS`: ``"module:function"`` with the signature of
  :func:`staleflow.runtime.workers.specs.build_embedded_engine`:
  ``build(spec: RolloutSpec, seed: int, placement: EnginePlacement) -> RolloutEngine``,
  called inside the instance's Ray actor (which holds the first bundle of the instance's
  placement group; ``placement`` names the others, for TP workers).
- :data:`TRAINER_POOLS`: a :class:`TrainerBackend`: ``pool`` is ``"module:function"``
  with the signature of :func:`staleflow.runtime.driver.pools.trainer.build_embedded_pool`
  (``ctx, spec, ps, control, recovery``: ``recovery`` says how its ranks find a restarted
  PS replica), returning a :class:`staleflow.runtime.driver.pools.trainer.TrainerPool`, whose
  ``save_checkpoint`` writes the trainer's part of a run checkpoint; ``ranks`` says how
  many bundles the trainer gang needs, from the ``trainer`` section alone (no imports);
  ``check`` (optional, ``"module:function"``) takes the ``trainer``, ``model`` and
  ``recovery`` sections and raises a ``ValueError`` naming the key and the fix for
  settings the backend cannot run (it runs in :func:`check_backends`, before Ray is
  joined or a model loaded).

Importing this module imports no backend. A backend absent here is refused by
:func:`check_backends` before anything starts, never replaced by another one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from staleflow.engines import BACKENDS
from staleflow.engines.preflight import BackendSettingError, check_rollout_backend
from staleflow.runtime.errors import LaunchError
from staleflow.trainers import TRAINERS

if TYPE_CHECKING:
    from staleflow.config import ModelConfig, RecoveryConfig, RolloutConfig, TrainerConfig


def _one_rank(trainer: TrainerConfig) -> int:
    return 1


def _parallel_ranks(trainer: TrainerConfig) -> int:
    return trainer.dp * trainer.tp * trainer.pp


@dataclass(frozen=True)
class TrainerBackend:
    pool: str  # "module:function" building the trainer pool
    ranks: Callable[[TrainerConfig], int] = _one_rank
    check: str = ""  # "module:function" refusing settings the backend cannot run


ENGINE_BUILDERS: dict[str, str] = {
    "embedded": "staleflow.runtime.workers.specs:build_embedded_engine",
    "vllm": "staleflow.runtime.workers.specs:build_served_engine",
    "sglang": "staleflow.runtime.workers.specs:build_served_engine",
}
TRAINER_POOLS: dict[str, TrainerBackend] = {
    "embedded": TrainerBackend("staleflow.runtime.driver.pools.trainer:build_embedded_pool"),
    "megatron": TrainerBackend(
        "staleflow.runtime.driver.pools.megatron:build_megatron_pool",
        ranks=_parallel_ranks,
        check="staleflow.trainers.megatron.checks:check_run",
    ),
}


def load_hook(path: str) -> Any:
    """The object at ``"module:attribute"``, imported now."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _registered(kind: str, name: str) -> bool:
    """Whether the backend's own registry lists ``name`` with an implementation."""
    if kind == "rollout":
        return BACKENDS.get(name) is not None

    return name in TRAINERS


def check_backend_names(rollout: str, trainer: str) -> None:
    """Refuse a ``rollout`` or ``trainer`` backend name ``launch`` cannot build, rather
    than quietly running another one in its place (the config accepts every name it
    knows). Imports no backend: the run plan asks it before it counts a trainer's ranks."""
    for kind, key, value, hooks in (
        ("rollout", "rollout.backend", rollout, ENGINE_BUILDERS),
        ("trainer", "trainer.backend", trainer, TRAINER_POOLS),
    ):
        if value not in hooks or not _registered(kind, value):
            built = " | ".join(n for n in hooks if _registered(kind, n))
            raise LaunchError(
                f"{key}={value} is not implemented in staleflow launch yet (it builds: "
                f"{built}): use {key}={next(iter(hooks))}"
            )


def check_backends(
    rollout: RolloutConfig,
    trainer: TrainerConfig,
    model: ModelConfig,
    recovery: RecoveryConfig,
    *,
    address: str = "",
) -> None:
    """Refuse a backend ``launch`` cannot build (:func:`check_backend_names`), and settings
    of the run's sections its backends cannot run (on the Ray cluster at ``address``; ''
    local)."""
    check_backend_names(rollout.backend, trainer.backend)
    # The engine's own settings (installed? model folder? TP vs GPUs?), by key and fix.

    try:
        check_rollout_backend(rollout, model, address=address)
    except BackendSettingError as exc:
        raise LaunchError(str(exc)) from None
    # The trainer's (installed? does its parallelism split this model?), the same way.
    check = trainer_backend(trainer.backend).check
    if check:
        try:
            load_hook(check)(trainer, model, recovery)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None


def engine_builder(backend: str) -> str:
    """The build hook of rollout backend ``backend`` (``"module:function"``)."""
    return ENGINE_BUILDERS[backend]


def trainer_backend(backend: str) -> TrainerBackend:
    return TRAINER_POOLS[backend]
