"""Prompt data: the built-in arithmetic task, local JSONL / Parquet datasets and Hugging
Face ``datasets`` sources, prompt formats (chat templates), offline tokenizers, and the
deterministic sampler the trajectory server draws from."""

from staleflow.data.datasets import (
    PromptDataset,
    PromptFormat,
    Sample,
    load_dataset,
    load_jsonl,
    load_parquet,
    synthetic_dataset,
)
from staleflow.data.hf_datasets import load_hf_dataset
from staleflow.data.layouts import (
    BUILTIN_LAYOUTS,
    DAPO_MATH,
    GSM8K,
    DatasetError,
    RecordLayout,
)
from staleflow.data.sampler import PromptSampler
from staleflow.data.synthetic import ALPHABET, ArithmeticConfig, ArithmeticTask, Problem, check
from staleflow.data.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)

__all__ = [
    "ALPHABET",
    "BUILTIN_LAYOUTS",
    "DAPO_MATH",
    "GSM8K",
    "ArithmeticConfig",
    "ArithmeticTask",
    "CharTokenizer",
    "DatasetError",
    "HFTokenizer",
    "Problem",
    "PromptDataset",
    "PromptFormat",
    "PromptSampler",
    "RecordLayout",
    "Sample",
    "Tokenizer",
    "TokenizerError",
    "check",
    "load_dataset",
    "load_hf_dataset",
    "load_jsonl",
    "load_parquet",
    "load_tokenizer",
    "synthetic_dataset",
]
