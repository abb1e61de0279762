"""The ``data`` section: where prompts and their ground truths come from, which fields
hold them, and how a prompt becomes ids (as written, or through the tokenizer's chat
template with an optional system prompt). Its own module as ``rollout`` has one;
:mod:`staleflow.config.sections` re-exports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from coordinator.config import ConfigError
from staleflow.config.checks import (
    MAX_SEQUENCE_TOKENS,
    SEQUENCE_WHY,
    _help,
    require,
    require_at_least,
    require_choice,
)
from staleflow.config.env import ENV_TASKS
from staleflow.config.walk import check_types
from staleflow.data.layouts import RecordLayout
from staleflow.data.synthetic import ArithmeticConfig

FILE_TASKS = ("gsm8k", "dapo", "jsonl", "parquet", "hf")
DATA_TASKS = ("arithmetic", *FILE_TASKS, *ENV_TASKS)


@dataclass(frozen=True, slots=True)
class DataConfig:
    """Where prompts and their ground truths come from."""

    KEY: ClassVar[str] = "data"

    task: str = field(
        default="arithmetic",
        metadata=_help(
            "arithmetic (built in) | calculator (built in, multi-turn with a tool: the env "
            "section) | gsm8k | dapo | jsonl | parquet (local files at data.path) "
            "| hf (a Hugging Face datasets folder or files at data.path) | env (the "
            "environment env.name, its problems at data.path: docs/agentic.md)"
        ),
    )
    path: str = field(
        default="",
        metadata=_help(
            "local .jsonl or .parquet file of a file task; for hf: a save_to_disk folder, or "
            ".arrow / .parquet / .json(l) / .csv files (a glob is allowed)"
        ),
    )
    split: str = field(
        default="train", metadata=_help("the split data.task=hf reads (of a DatasetDict)")
    )
    prompt_column: str = field(
        default="",
        metadata=_help(
            "the field holding the prompt (text, or a chat list of {role, content}; a.b "
            "reads a nested field); '' = detect the GSM8K or DAPO-Math layout (data.task=env: "
            "'prompt')"
        ),
    )
    answer_column: str = field(
        default="",
        metadata=_help(
            "the field holding the ground truth; set with data.prompt_column (data.task=env: "
            "'answer')"
        ),
    )
    chat_template: bool = field(
        default=False,
        metadata=_help(
            "render every prompt through the tokenizer's chat template (instruct models); "
            "false tokenizes text as written"
        ),
    )
    system_prompt: str = field(
        default="",
        metadata=_help("a system message put before each prompt (needs data.chat_template)"),
    )
    difficulty: int = field(
        default=2,
        metadata=_help(
            "level of the arithmetic task, 1 (one-digit sums) to 5",
            5,
            "the built-in task has levels 1 to 5",
        ),
    )
    tokenizer: str = field(
        default="",
        metadata=_help(
            "local tokenizer (HF directory or CharTokenizer .json) replacing model.checkpoint's "
            "own; '' = the checkpoint's"
        ),
    )
    max_prompt_tokens: int = field(
        default=512,
        metadata=_help("prompts longer than this are skipped", MAX_SEQUENCE_TOKENS, SEQUENCE_WHY),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_choice("data.task", self.task, DATA_TASKS)

        try:
            ArithmeticConfig.level(self.difficulty)
        except ValueError as exc:
            raise ConfigError(f"data.difficulty={self.difficulty} is out of range: {exc}") from None
        require_at_least("data.max_prompt_tokens", self.max_prompt_tokens, 1, "token")
        if bool(self.prompt_column) != bool(self.answer_column):
            unset = "data.answer_column" if self.prompt_column else "data.prompt_column"
            raise ConfigError(
                f"{unset} is not set: name both data.prompt_column and data.answer_column "
                "(the dataset's fields), or neither to detect the GSM8K or DAPO-Math layout"
            )
        require(
            not self.system_prompt or self.chat_template,
            "data.system_prompt",
            self.system_prompt,
            "needs the chat template: set data.chat_template=true, or drop data.system_prompt",
        )
        require(
            not (self.chat_template and self.task == "arithmetic"),
            "data.chat_template",
            self.chat_template,
            "does not apply to the built-in arithmetic task, whose tokenizer has no chat "
            "template: set data.chat_template=false",
        )
        require(bool(self.split), "data.split", self.split, "is empty: use e.g. train")
        suffixes = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet", ".pq")}.get(self.task)
        if self.path and suffixes:
            require(
                self.path.endswith(suffixes),
                "data.path",
                self.path,
                f"does not end in {' or '.join(suffixes)} as data.task={self.task} needs: "
                "fix the path, or set data.task to the file's format",
            )

    def record_layout(self) -> RecordLayout | None:
        """The fields data.prompt_column / data.answer_column name (of the training
        prompts and of the held-out set); None: detect a built-in layout."""
        if not self.prompt_column:
            return None
        return RecordLayout(self.prompt_column, self.answer_column, name="data.prompt_column")
