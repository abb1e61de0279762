"""The embedded trainer: GRPO with an off-policy correction, in PyTorch, in-process.

Meant for small models on CPU (the built-in task) and for tests of the asynchronous
pipeline; large models go to the Megatron backend (``staleflow.trainers.megatron``). The
step itself (sequences, advantages, the loss at the batch's temperature, micro-batches,
metrics) is :func:`staleflow.trainers.rl.train_step`, shared with that backend; this
module holds the whole model and vocabulary in one process and takes AdamW steps.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from parameter_server.torch_compat import to_numpy
from staleflow.config.sections import TrainerConfig
from staleflow.models import lora
from staleflow.models.checkpoint import save_pretrained
from staleflow.models.state import load_policy_state, policy_state
from staleflow.trainers.batch_checks import BatchError
from staleflow.trainers.reference import DenseReference, frozen_copy, load_reference
from staleflow.trainers.rl import (
    LocalReduce,
    SingleStage,
    adamw,
    dense_token_stats,
    train_step,
)
from staleflow.trainers.rng import rng_state as _rng_state
from staleflow.trainers.rng import set_rng_state as _set_rng_state
from staleflow.trainers.streamed import StreamedStep
from trajectory_server.types import TrainingBatch

if TYPE_CHECKING:
    from staleflow.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["BatchError", "EmbeddedTrainer"]

_STATE_FILE = "trainer_state.json"
_OPTIMIZER_FILE = "optimizer.pt"
_R = TypeVar("_R")
_RNG_FILE = "rng.pt"  # torch's generators (a step seeds its own from seed and version)
# the frozen reference of the KL term: kept with the checkpoint, so that a resumed run
# keeps the KL to the run's initial policy (not to the weights it resumes from)
# (in a folder of its own: vLLM loads every *.safetensors beside config.json)
_REFERENCE_FILE = "reference/model.safetensors"
# a LoRA trainer's adapter (a PEFT folder) and its exact frozen base
_ADAPTER_DIR = "adapter"
_BASE_FILE = "base/model.safetensors"


class _DenseBackend(SingleStage, LocalReduce):
    """:class:`staleflow.trainers.rl.StepBackend` of a whole model in one process."""

    token_stats = staticmethod(dense_token_stats)

    def __init__(self, trainer: EmbeddedTrainer) -> None:
        self._trainer = trainer
        self.vocab_size = int(trainer.model.get_input_embeddings().weight.shape[0])

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        # LoRA dropout acts in the gradient pass only: the no-grad passes (proximal,
        # reference) score the policy itself, as the engines do
        dropout = self._trainer._dropout if torch.is_grad_enabled() else []
        for m in dropout:
            m.train()
        try:
            return self._trainer.model(input_ids=ids, use_cache=False).logits
        finally:
            for m in dropout:
                m.eval()

    def zero_grad(self) -> None:
        self._trainer.optimizer.zero_grad(set_to_none=True)

    def scale_grads(self, factor: float) -> None:
        for p in self._trainer._params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def update(self) -> float:
        t = self._trainer
        grad_norm = float(torch.nn.utils.clip_grad_norm_(t._params, t.config.max_grad_norm))
        if math.isfinite(grad_norm):
            t.optimizer.step()
        else:
            logger.warning("step %d: gradient norm %s; skipping the update", t.version, grad_norm)
        t.optimizer.zero_grad(set_to_none=True)
        return grad_norm


class EmbeddedTrainer:
    """Trains ``model`` in place; implements :class:`staleflow.trainers.Trainer`.

    ``config`` is the ``trainer`` section of the run configuration (its loss and optimizer
    settings; the parallelism keys are the Megatron backend's). ``pad_id`` pads sequences
    (any id works: padding sits after every real token and causal attention never looks
    ahead). ``version`` is the policy version of the weights as given. ``tokenizer``, if
    given, is saved with checkpoints so that they load with
    :func:`staleflow.models.load_pretrained`. ``seed`` seeds the torch RNG around each step
    (with the version), so a model with stochastic layers trains reproducibly without
    touching global state; ``num_threads`` sets torch's intra-op threads during a step.
    When the loss has a KL term (``config.kl_coef``, ``config.ref``), ``reference`` is the
    frozen reference policy; None takes a frozen copy of ``model`` as given (the initial
    policy).

    With ``config.lora.enabled`` the trainer trains a LoRA adapter on the frozen weights of
    ``model`` (:mod:`staleflow.models.lora`; injected here, from ``seed``, unless ``model``
    has adapters already): :meth:`export_weights` is then the adapter alone and
    :meth:`export_base_weights` the frozen base, and checkpoints keep both.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig | None = None,
        *,
        pad_id: int,
        version: int = 0,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        num_threads: int | None = None,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.config = config or TrainerConfig()
        self.pad_id = int(pad_id)
        self.seed = int(seed)
        self.num_threads = num_threads
        self._version = int(version)
        self.tokenizer = tokenizer
        self._lock = threading.Lock()  # a step and an export never interleave
        self.lora = self.config.lora.enabled
        if self.config.uses_reference and reference is None:
            reference = frozen_copy(model)  # the initial policy, before any adapter
        if self.lora and not lora.has_adapters(model):
            lora.add_adapters(model, self.config.lora, seed=self.seed)
        self._dropout = lora.dropout_modules(model) if self.lora else []
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = adamw(self._params, self.config)
        self._backend = _DenseBackend(self)
        self._stream: StreamedStep | None = None  # parts of the next step seen so far
        self.reference: torch.nn.Module | None = None
        self._reference: DenseReference | None = None
        if self.config.uses_reference and reference is not None:
            self.reference = reference
            self.reference.requires_grad_(False)
            self._reference = DenseReference(self.reference)

    @classmethod
    def from_section(
        cls,
        model: torch.nn.Module,
        section: TrainerConfig,
        *,
        pad_id: int,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        version: int = 0,
    ) -> EmbeddedTrainer:
        """The trainer of a run: its ``trainer`` section and the run's seed; the reference
        policy from ``trainer.ref.path`` when set."""
        reference = None
        if section.uses_reference and section.ref.path:
            reference = load_reference(model, section.ref.path)
        return cls(
            model,
            section,
            pad_id=pad_id,
            version=version,
            tokenizer=tokenizer,
            seed=seed,
            num_threads=section.num_threads,
            reference=reference,
        )

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        """One training step on ``batch``; see :func:`staleflow.trainers.rl.train_step`.
        After :meth:`stream`, ``batch`` holds the groups not streamed yet (possibly none)
        and the step covers the streamed ones too."""
        with self._lock:
            start = time.perf_counter()
            stream, self._stream = self._stream, None
            if stream is None:
                metrics = self._run(
                    lambda: train_step(
                        self._backend,
                        batch,
                        self.config,
                        version=self._version,
                        pad_id=self.pad_id,
                        reference=self._reference,
                    )[0]
                )
            else:
                if batch.groups:
                    self._run(lambda: stream.add(batch))
                metrics = self._run(lambda: stream.finish()[0])
            self._version += 1
            metrics["train/lr"] = float(self.optimizer.param_groups[0]["lr"])
            metrics["train/step_time_s"] = time.perf_counter() - start
            return metrics

    def stream(self, part: TrainingBatch) -> None:
        """Forward/backward on groups of the next step's batch before the rest is in
        (``trainer.stream``, :mod:`staleflow.trainers.streamed`); :meth:`train_step`
        adds the remaining groups and updates."""
        with self._lock:
            if self._stream is None:
                self._stream = StreamedStep(
                    self._backend,
                    self.config,
                    version=self._version,
                    pad_id=self.pad_id,
                    reference=self._reference,
                )
            stream = self._stream
            self._run(lambda: stream.add(part))

    def drop_stream(self) -> None:
        """Forget the parts streamed for a step that will not be taken (the run stops)."""
        with self._lock:
            self._stream = None
            self.optimizer.zero_grad(set_to_none=True)

    def _run(self, work: Callable[[], _R]) -> _R:
        """``work`` in the step's context: dropout off (the loss must see the policy's own
        logprobs, as in verl/AReaL), the step's threads, torch's RNG seeded from the seed
        and the version without touching global state."""
        was_training = self.model.training
        self.model.eval()
        threads = torch.get_num_threads()
        try:
            if self.num_threads is not None:
                torch.set_num_threads(self.num_threads)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 1_000_003 + self._version)
                return work()
        finally:
            torch.set_num_threads(threads)
            self.model.train(was_training)

    # -- weights and checkpoints ------------------------------------------------------

    def export_weights(self) -> dict[str, np.ndarray]:
        """Copies of the current weights by :func:`~staleflow.models.policy_state` name;
        with LoRA, of the adapter alone (:func:`staleflow.models.lora.adapter_state`)."""
        with self._lock:
            state = lora.adapter_state(self.model) if self.lora else policy_state(self.model)
            return {name: to_numpy(t).copy() for name, t in state.items()}

    def export_base_weights(self) -> dict[str, np.ndarray]:
        """With LoRA, copies of the frozen base weights (the names of the model without
        adapters): what the parameter server and the instances get once."""
        if not self.lora:
            raise ValueError(
                "export_base_weights: this trainer trains the full weights "
                "(trainer.lora.enabled=false); export_weights holds them all"
            )
        with self._lock:
            return {n: to_numpy(t).copy() for n, t in lora.base_state(self.model).items()}

    def save_checkpoint(self, path: str | Path) -> None:
        """Weights (``model.safetensors`` with the model's ``config.json``), optimizer
        state, torch's RNG states, version and config, written to a temporary directory
        and renamed into place; an existing checkpoint at ``path`` is replaced.

        With LoRA, ``model.safetensors`` holds the merged policy (the folder loads in
        ``transformers`` as the trained model), ``adapter/`` the adapter as a PEFT folder
        (``peft``, vLLM, SGLang load it over the base) and ``base/`` the exact frozen
        weights, from which :meth:`load_checkpoint` and ``--resume`` continue."""

        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        old = out.parent / f".old-{out.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            try:
                merged = lora.merged_state(self.model) if self.lora else None
                if self.tokenizer is not None:
                    save_pretrained(self.model, self.tokenizer, tmp, merged)
                else:
                    self.model.save_pretrained(tmp, state_dict=merged)
                if self.lora:
                    lora.save_adapter(
                        lora.adapter_state(self.model), self.config.lora, tmp / _ADAPTER_DIR
                    )
                    _save_tensors(lora.base_state(self.model), tmp / _BASE_FILE)
                torch.save(self.optimizer.state_dict(), tmp / _OPTIMIZER_FILE)
                torch.save(_rng_state(), tmp / _RNG_FILE)
                if self.reference is not None:
                    _save_reference(self.reference, tmp / _REFERENCE_FILE)
                state = {"version": self._version, "config": asdict(self.config)}
                (tmp / _STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
                if out.exists():
                    out.rename(old)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
        logger.info("saved trainer checkpoint (version %d) to %s", self._version, out)

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore weights, optimizer state, RNG states and version written by
        :meth:`save_checkpoint`."""
        from safetensors.torch import load_file

        p = Path(path)
        shards = sorted(p.glob("*.safetensors")) if p.is_dir() else []
        for name in (_OPTIMIZER_FILE, _STATE_FILE):
            if not (p / name).is_file():
                raise FileNotFoundError(f"{p}: not a trainer checkpoint (no {name})")
        if not shards:
            raise FileNotFoundError(f"{p}: not a trainer checkpoint (no *.safetensors)")
        if self.lora and not (p / _BASE_FILE).is_file():
            raise FileNotFoundError(
                f"{p}: not a LoRA trainer checkpoint (no {_BASE_FILE}): resume it with "
                "trainer.lora.enabled=false, or start the LoRA run from it with "
                f"model.checkpoint={p}"
            )
        state = json.loads((p / _STATE_FILE).read_text())
        with self._lock:
            if self.lora:
                lora.load_base_state(self.model, load_file(str(p / _BASE_FILE)))
                lora.load_adapter_state(self.model, lora.load_adapter(p / _ADAPTER_DIR))
            else:
                tensors: dict[str, torch.Tensor] = {}
                for shard in shards:  # large models are saved in several shards
                    tensors.update(load_file(str(shard)))
                names = set(dict(self.model.named_parameters()))
                load_policy_state(self.model, {k: v for k, v in tensors.items() if k in names})
            self.optimizer.load_state_dict(torch.load(p / _OPTIMIZER_FILE, weights_only=True))
            if (p / _RNG_FILE).is_file():  # absent in checkpoints written before it was kept
                _set_rng_state(torch.load(p / _RNG_FILE, weights_only=True))
            if self.reference is not None and (p / _REFERENCE_FILE).is_file():
                load_policy_state(self.reference, load_file(str(p / _REFERENCE_FILE)))
            elif self.reference is not None:
                logger.warning(
                    "the checkpoint %s holds no reference policy (written without a KL "
                    "term): the KL is to the policy the trainer was built with",
                    p,
                )
            self._version = int(state["version"])
        logger.info("loaded trainer checkpoint (version %d) from %s", self._version, p)

    def __repr__(self) -> str:
        c = self.config
        adapter = f", lora_rank={c.lora.rank}" if self.lora else ""
        return (
            f"EmbeddedTrainer(version={self._version}, lr={c.lr}, off_policy={c.off_policy!r}, "
            f"advantage={c.advantage!r}{adapter})"
        )


def _save_reference(model: torch.nn.Module, path: Path) -> None:
    _save_tensors(policy_state(model), path)


def _save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    # tied weights share storage, which safetensors refuses: each name gets its own copy
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, path)
