"""The supervised warm-up: a policy for the built-in task that RL can start from.

RL learns only from groups whose rewards differ, so a freshly initialised model, which
never produces a right answer, gives it nothing to learn from. A short supervised run on
prompt -> :func:`~staleflow.data.synthetic.solution_steps` fixes that: it teaches the
response format and part of the arithmetic, leaving accuracy well below 100% for RL to
raise. The result is cached on disk, keyed by everything that affects it, so only the
first run on a machine pays for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from staleflow.data.synthetic import (
    ALPHABET,
    ArithmeticConfig,
    ArithmeticTask,
    Problem,
    solution_steps,
)
from staleflow.data.tokenizer import Tokenizer
from staleflow.models.build import build_arithmetic_model
from staleflow.models.checkpoint import load_pretrained, save_pretrained
from staleflow.models.presets import ModelPreset, get_preset
from staleflow.models.sampling import evaluate_accuracy
from staleflow.models.threads import FreeCores, idle_cores, torch_threads
from staleflow.progress import SILENT, Progress

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# Measured on 2 CPU cores: 500 steps of 128 level-2 problems take ~85 s with 2 torch
# threads on idle cores (0.17 s a step) and ~225 s with 1 thread on cores shared with
# other jobs. Learning is abrupt and its timing depends on the seed: after a fixed 500
# steps, sampled accuracy at T=1 is 27% for seed 0 and 7% for seed 1; with the 1200-step
# schedule, validation accuracy crosses 25% at ~575 steps for seed 0 and ~700 for seed 1.
# So staleflow launch stops at a target accuracy (model.warmup_target) instead of a count.
DEFAULT_PRESET = "tiny"
DEFAULT_LEVEL = 2
DEFAULT_STEPS = 500
DEFAULT_BATCH_SIZE = 128
DEFAULT_LR = 2e-3
CHECK_EVERY = 25  # steps between validation checks of a warm-up with a target accuracy
VALIDATION_PROBLEMS = 256
META_FILE = "warmup.json"
_CACHE_FORMAT = 1  # bump when the warm-up procedure changes what it produces


def default_task_config(seed: int = 0) -> ArithmeticConfig:
    """The arithmetic task the default warm-up and RL runs use."""
    return ArithmeticConfig.level(DEFAULT_LEVEL, seed=seed)


def default_cache_dir() -> Path:
    """``$STALEFLOW_CACHE/warmup`` if set, else ``~/.cache/staleflow/warmup``."""
    root = os.environ.get("STALEFLOW_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "staleflow"
    return base / "warmup"


def _warmup_task(task: ArithmeticTask, seed: int) -> ArithmeticTask:
    """The problem stream of a warm-up: the task's difficulty, its own problem sequence,
    so that an RL dataset drawn from the same config does not replay it in order."""
    digest = hashlib.sha256(f"staleflow-warmup:{task.config.seed}:{seed}".encode()).digest()
    return ArithmeticTask(replace(task.config, seed=int.from_bytes(digest[:8], "little")))


def _collate(
    problems: Sequence[Problem], tokenizer: Tokenizer
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded ``[bos] prompt response [eos]`` ids and next-token labels that are
    -100 except on the response and EOS."""
    rows: list[np.ndarray] = []
    starts: list[int] = []
    for p in problems:
        prompt = tokenizer.encode(p.prompt, add_bos=True)
        target = tokenizer.encode(solution_steps(p))
        rows.append(np.concatenate([prompt, target, [tokenizer.eos_id]]).astype(np.int64))
        starts.append(len(prompt))
    width = max(map(len, rows))
    ids = np.full((len(rows), width), tokenizer.pad_id, dtype=np.int64)
    labels = np.full((len(rows), width), -100, dtype=np.int64)
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        ids[i, : len(row)] = row
        # the label at position t is the token at t + 1
        labels[i, start - 1 : len(row) - 1] = row[start:]
    return torch.from_numpy(ids), torch.from_numpy(labels), int((labels >= 0).sum())


@dataclass(frozen=True, slots=True)
class WarmupStats:
    steps: int
    examples: int
    target_tokens: int
    seconds: float
    first_loss: float
    final_loss: float  # mean over the last tenth of the steps


def _lr_factor(step: int, steps: int, warmup_steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    task: ArithmeticTask | None,
    *,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    warmup_frac: float = 0.05,
    num_threads: int | None = None,
    log_every: int = 50,
    on_step: Callable[[int, float], None] | None = None,
    stop: Callable[[int], bool] | None = None,
    check_every: int = 25,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor, int]] | None = None,
) -> WarmupStats:
    """Supervised next-token training of ``model`` in place on prompt -> solution.

    Step ``k`` trains on problems ``k * batch_size ..`` of a problem stream derived from
    ``task`` and ``seed``; the loss is the mean cross-entropy over response and EOS
    tokens (prompts are context only). AdamW, linear warm-up then cosine decay, gradient
    clipping. Deterministic for a seed on a given machine and thread count.
    ``on_step(step, loss)`` is called after each step (progress, evaluation).
    ``stop(step)``, asked every ``check_every`` steps, ends the run early when it returns
    True (the schedule stays the one of ``steps``); ``WarmupStats.steps`` says how many ran.
    ``batches(step)``: the step's (ids, labels, trained tokens) in place of the task's
    problems (another task's demonstrations, e.g. ``staleflow.models.tool_warmup``).
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps}, batch_size={batch_size}; both must be at least 1")
    if lr <= 0:
        raise ValueError(f"lr={lr}; it must be positive")
    if task is None and batches is None:
        raise ValueError("warmup needs a task, or batches(step) that give each step's batch")
    stream = _warmup_task(task, seed) if batches is None else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay, foreach=True
    )
    warmup_steps = max(1, int(warmup_frac * steps))
    losses: list[float] = []
    tokens = 0
    was_training = model.training
    model.train()
    start = time.perf_counter()
    with torch_threads(num_threads):
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr * _lr_factor(step, steps, warmup_steps)
            if stream is None:
                ids, labels, n = batches(step)  # type: ignore[misc]  # set when stream is not
            else:
                ids, labels, n = _collate(stream.problems(batch_size, step * batch_size), tokenizer)
            # right padding needs no attention mask: causal attention never lets a real
            # token see the padding after it
            logits = model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
            tokens += n
            if on_step is not None:
                on_step(step + 1, losses[-1])
            if log_every and (step + 1) % log_every == 0:
                logger.info(
                    "warm-up step %d/%d: loss %.4f (%.1fs)",
                    step + 1,
                    steps,
                    losses[-1],
                    time.perf_counter() - start,
                )
            if stop is not None and (step + 1) % check_every == 0 and stop(step + 1):
                break
    model.train(was_training)
    done = len(losses)
    tail = losses[-max(1, done // 10) :]
    return WarmupStats(
        steps=done,
        examples=done * batch_size,
        target_tokens=tokens,
        seconds=time.perf_counter() - start,
        first_loss=losses[0],
        final_loss=float(np.mean(tail)),
    )


def _validation_task(task_config: ArithmeticConfig) -> ArithmeticTask:
    """Problems the warm-up stops on: apart from the held-out ones it reports."""
    return ArithmeticTask(replace(task_config, seed=task_config.seed + 2_000_003))


def _eval_task(task_config: ArithmeticConfig) -> ArithmeticTask:
    """Held-out problems: a problem sequence neither the warm-up nor an RL dataset of the
    same config starts with (the problem space may still overlap for easy levels)."""
    return ArithmeticTask(replace(task_config, seed=task_config.seed + 1_000_003))


def cache_key(
    preset: ModelPreset,
    task_config: ArithmeticConfig,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> dict[str, Any]:
    """Everything that determines the warmed weights."""
    import transformers

    return {
        "format": _CACHE_FORMAT,
        "preset": preset.to_dict(),
        "alphabet": ALPHABET,
        "task": asdict(task_config),
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _threads_now(share: FreeCores | None, step: int) -> str:
    """Every ``CHECK_EVERY`` steps, as many torch threads as there are free cores (a
    second thread on a core another job uses makes a step ~10x slower); the count, for
    the progress line."""
    if share is not None and step % CHECK_EVERY == 0:
        free = share()
        if free is not None and free != torch.get_num_threads():
            logger.info("warm-up step %d: %d free cores, %d torch threads now", step, free, free)
            torch.set_num_threads(free)
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''}"


def _train_warm(
    preset: ModelPreset,
    task_config: ArithmeticConfig,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    num_threads: int,
    target_accuracy: float | None,
    on_step: Callable[[int, float], None],
    on_check: Callable[[float], None],
) -> tuple[PreTrainedModel, Tokenizer, dict[str, Any]]:
    """A freshly built model warmed up (stopping at ``target_accuracy`` if given), and the
    ``warmup.json`` facts of the run (``stats``, ``validation``)."""
    model, tokenizer = build_arithmetic_model(preset, seed=seed)
    checks: list[tuple[int, float]] = []

    def reached(step: int) -> bool:
        accuracy = evaluate_accuracy(
            model, tokenizer, _validation_task(task_config), VALIDATION_PROBLEMS, 1.0, seed=seed
        )
        checks.append((step, accuracy))
        on_check(accuracy)
        logger.info("warm-up step %d: validation accuracy at T=1 %.1f%%", step, 100 * accuracy)
        return target_accuracy is not None and accuracy >= target_accuracy

    stats = warmup(
        model,
        tokenizer,
        ArithmeticTask(task_config),
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        stop=reached if target_accuracy is not None else None,
        check_every=CHECK_EVERY,
        seed=seed,
        num_threads=num_threads,
        on_step=on_step,
        log_every=0,
    )
    meta: dict[str, Any] = {"stats": asdict(stats)}
    if target_accuracy is not None:
        meta["validation"] = checks
        if not checks or checks[-1][1] < target_accuracy:
            logger.warning(
                "the warm-up ended after %d steps below its target accuracy %.0f%%; raise "
                "model.warmup_steps if RL finds too few right answers",
                stats.steps,
                100 * target_accuracy,
            )
    return model, tokenizer, meta


def ensure_warm_checkpoint(
    preset: str | ModelPreset = DEFAULT_PRESET,
    task_config: ArithmeticConfig | None = None,
    *,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    num_threads: int | None = None,
    eval_problems: int = 256,
    target_accuracy: float | None = None,
    progress: Progress = SILENT,
) -> Path:
    """The directory of a warmed checkpoint (model, tokenizer, ``warmup.json``), built on
    the first call and reused after.

    The entry is named by a hash of :func:`cache_key`; it is written into a temporary
    directory and renamed into place, so a crash leaves no half-written entry and two
    processes warming at once both end with a complete one. ``eval_problems`` held-out
    problems are sampled at temperature 1.0 after training to log (and record) the
    starting accuracy; 0 skips that. ``num_threads``: torch threads while warming (None:
    :func:`idle_cores`); on cores busy with other processes 1 thread is far faster than
    an oversubscribed 2 (measured 10x). ``progress`` gets a ``warmup`` phase: steps, loss,
    validation accuracy and the time left.

    ``target_accuracy``: stop as soon as the sampled (T=1) accuracy on
    ``VALIDATION_PROBLEMS`` validation problems (a stream apart from the held-out one)
    reaches it, checked every ``CHECK_EVERY`` steps; ``steps`` is then the most it may
    take. Learning here is abrupt and its timing depends on the seed (seed 0 is at 27% after
    500 steps, seed 1 at 7%), so a fixed step count leaves some seeds nothing for RL to
    work with; a target gives every seed a comparable start.
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    name = preset if isinstance(preset, str) else "custom"
    task_config = task_config or default_task_config()
    if target_accuracy is not None and not 0.0 < target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy={target_accuracy}; use a share in (0, 1], or None")
    key = cache_key(p, task_config, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    if target_accuracy is not None:
        key["target_accuracy"] = target_accuracy
        key["check"] = [CHECK_EVERY, VALIDATION_PROBLEMS]
    root, final = cache_entry(cache_dir, name, key)
    if (final / META_FILE).is_file():
        logger.debug("warm-up cache hit: %s", final)
        return final

    threads = idle_cores() if num_threads is None else num_threads
    # with no thread count given, follow the free cores as other jobs come and go
    share = FreeCores() if num_threads is None else None
    logger.info(
        "warming up a %s model on %s for at most %d steps on %d threads (cached in %s)",
        name,
        task_config,
        steps,
        threads,
        root,
    )
    phase = progress.phase(
        "warmup",
        f"warming up the built-in {name} model",
        total=steps,
        unit="steps",
        upper_bound=target_accuracy is not None,
        goal="" if target_accuracy is None else f"accuracy {target_accuracy:.0%}",
    )
    with phase:
        model, tokenizer, meta = _train_warm(
            p,
            task_config,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            num_threads=threads,
            target_accuracy=target_accuracy,
            on_step=lambda step, loss: phase.update(
                done=step, loss=loss, detail=_threads_now(share, step)
            ),
            on_check=lambda accuracy: phase.update(accuracy=accuracy),
        )
        meta["key"] = key
        meta["preset_name"] = name
        if eval_problems > 0:
            with torch_threads(threads):
                accuracy = evaluate_accuracy(
                    model, tokenizer, _eval_task(task_config), eval_problems, 1.0, seed=seed
                )
            meta["accuracy_t1"] = accuracy
            meta["eval_problems"] = eval_problems
        stats = meta["stats"]
        phase.finish(
            f"stopped at step {stats['steps']}"
            + (f", held-out accuracy {meta['accuracy_t1']:.1%}" if eval_problems > 0 else "")
        )
    logger.info(
        "warm-up done in %.1fs: loss %.3f -> %.3f%s",
        stats["seconds"],
        stats["first_loss"],
        stats["final_loss"],
        f", held-out accuracy at T=1: {meta['accuracy_t1']:.1%}" if eval_problems > 0 else "",
    )

    store_entry(model, tokenizer, meta, root, final)
    return final


def cache_entry(cache_dir: str | Path | None, name: str, key: dict[str, Any]) -> tuple[Path, Path]:
    """(the cache root, the entry's directory) of a warm-up keyed by ``key``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root, root / f"{name}-{digest}"


def store_entry(
    model: PreTrainedModel, tokenizer: Tokenizer, meta: dict[str, Any], root: Path, final: Path
) -> None:
    """Write a warmed model into its cache entry: into a temporary directory renamed into
    place, so a crash leaves no half-written entry and two processes warming at once both
    end with a complete one."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_pretrained(model, tokenizer, tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        try:
            tmp.rename(final)
        except OSError:
            if not (final / META_FILE).is_file():
                raise
            logger.info("another process cached %s first; using its copy", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_warm_model(
    preset: str | ModelPreset = DEFAULT_PRESET,
    task_config: ArithmeticConfig | None = None,
    *,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    num_threads: int | None = None,
    eval_problems: int = 256,
    target_accuracy: float | None = None,
    progress: Progress = SILENT,
) -> tuple[PreTrainedModel, Tokenizer]:
    """A warmed policy and its tokenizer for the built-in task, from the cache when there
    (see :func:`ensure_warm_checkpoint`)."""
    path = ensure_warm_checkpoint(
        preset,
        task_config,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        cache_dir=cache_dir,
        num_threads=num_threads,
        eval_problems=eval_problems,
        target_accuracy=target_accuracy,
        progress=progress,
    )
    return load_pretrained(path)


def read_warmup_meta(path: str | Path) -> dict[str, Any]:
    """The ``warmup.json`` of a cached warm-up checkpoint."""
    return json.loads((Path(path) / META_FILE).read_text())
