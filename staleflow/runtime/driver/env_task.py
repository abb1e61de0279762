"""An environment task's environment and problems, from the configuration.

``data.task=calculator`` is the built-in environment with the built-in arithmetic
problems. ``data.task=env`` is the environment ``env.name`` (registered, or
``module:attribute``) with one problem per row of ``data.path``: a ``.jsonl`` or
``.parquet`` file, or (any other path: a ``save_to_disk`` folder, ``.arrow`` / ``.csv``
files, a glob) a Hugging Face ``datasets`` source read with ``data.split``. A row gives
the prompt text (``data.prompt_column``, default ``prompt``), the ground truth
(``data.answer_column``, default ``answer``) and every field the environment names in
its ``columns``.

:func:`check_env_task` runs in the launcher's preflight, before Ray or the policy: an
environment that does not import, is not an :class:`~staleflow.envs.Environment` or
cannot be built, and a file whose rows lack a field the environment needs, are refused
there with a :class:`LaunchError` that says what to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from staleflow.data import ArithmeticConfig, PromptDataset
from staleflow.data.datasets import file_rows
from staleflow.data.heldout import EVAL_SEED_OFFSET
from staleflow.data.hf_datasets import open_hf_dataset
from staleflow.data.layouts import DatasetError, RecordLayout
from staleflow.envs import EnvContractError, Environment, EnvSample, make_environment
from staleflow.envs.calculator import calculator_samples
from staleflow.envs.formats import episode_dataset, turn_format
from staleflow.envs.samples import env_samples, sample_columns
from staleflow.runtime.errors import LaunchError

if TYPE_CHECKING:
    from staleflow.data.tokenizer import Tokenizer
    from staleflow.runtime.driver.run_plan import TaskPlan

CALCULATOR_PROBLEMS = 20_000  # the built-in task's problems per run (a stream, seeded)
DEFAULT_LAYOUT = RecordLayout("prompt", "answer", name="environment")
PLAIN_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq")  # read without `datasets`


def task_environment(task: TaskPlan) -> Environment:
    """The environment of the run's task, built as the reward workers build it."""
    name = task.env.environment(task.data.task)
    key = "env.name" if task.data.task == "env" else "data.task"
    try:
        return make_environment(name, **task.env.options(name))
    except (ValueError, ImportError, EnvContractError) as exc:
        raise LaunchError(f"{key}={name}: {exc}") from exc


def task_samples(task: TaskPlan, env: Environment) -> list[EnvSample]:
    """The problems of the run's environment task. Raises :class:`DatasetError`, or
    :class:`LaunchError` for an environment whose ``columns`` are malformed."""
    data = task.data
    if data.task == "calculator":
        problems = ArithmeticConfig.level(data.difficulty, seed=task.seed + 1)
        return calculator_samples(problems, size=CALCULATOR_PROBLEMS)
    try:
        columns = sample_columns(env)
    except EnvContractError as exc:
        raise LaunchError(f"env.name={task.env.name}: {exc}") from exc
    layout = data.record_layout() or DEFAULT_LAYOUT
    path = data.path
    return env_samples(
        _rows(path, data.split),
        path,
        prompt_field=layout.prompt_field,
        answer_field=layout.answer_field,
        columns=columns,
    )


def calculator_heldout(task: TaskPlan, problems: int) -> list[EnvSample]:
    """The first ``problems`` held-out problems of the built-in calculator task: the
    stream seeded ``seed + EVAL_SEED_OFFSET`` (as the arithmetic task's) without every
    problem the run's own samples hold (:func:`task_samples`). Disjoint by text, not only
    by seed: at the default level (two two-digit operands) the two streams would share
    most of their problems otherwise. Ids count from 0 in the held-out set."""
    trained = {s.prompt for s in task_samples(task, task_environment(task))}
    stream = ArithmeticConfig.level(task.data.difficulty, seed=task.seed + EVAL_SEED_OFFSET)
    kept: list[EnvSample] = []
    start, chunk = 0, max(4 * problems, 256)
    while len(kept) < problems and start < 64 * chunk:
        fresh = [s for s in calculator_samples(stream, chunk, start) if s.prompt not in trained]
        kept.extend(fresh[: problems - len(kept)])
        start += chunk
    if not kept:  # a level so small that the run's samples hold every problem
        raise LaunchError(
            f"no calculator problem of data.difficulty={task.data.difficulty} is outside "
            f"the run's {len(trained)} training problems, so none is held out; set "
            "eval.problems=0 or a higher data.difficulty"
        )
    return [EnvSample(i, s.prompt, s.answer, s.extra) for i, s in enumerate(kept)]


def _rows(path: str, split: str) -> Any:
    if Path(path).suffix in PLAIN_SUFFIXES:
        return file_rows(path)
    return enumerate(open_hf_dataset(path, split), start=1)


def check_env_task(task: TaskPlan) -> None:
    """Refuse, before anything starts, an environment task that could not run: the
    environment must build and every row of its problems must read."""
    env = task_environment(task)
    if task.data.task == "calculator":
        return  # the built-in problems
    try:
        samples = task_samples(task, env)
    except (DatasetError, ImportError) as exc:  # ImportError: `datasets`, for hf sources
        raise LaunchError(f"cannot read the environment's problems: {exc}") from exc
    first = samples[0]
    try:  # the first episode: a start() that cannot run on the data is a bad match
        env.start(first, seed=0)
    except Exception as exc:
        raise LaunchError(
            f"env.name={task.env.name}: start() failed on the first row of {task.data.path} "
            f"({first.to_json()[:200]}): {exc!r}; check that the rows hold what the "
            "environment reads (prompt, answer and its columns)"
        ) from exc


def env_dataset(task: TaskPlan, tokenizer: Tokenizer) -> PromptDataset:
    """The prompts of the run's environment task: each sample's first messages through
    the tokenizer's turn format, the sample itself as the ground truth (JSON)."""
    env = task_environment(task)
    return episode_dataset(env, task_samples(task, env), turn_format(tokenizer))
