"""Prompt data: the built-in arithmetic task, local JSONL / Parquet datasets, offline
tokenizers, and the deterministic sampler the trajectory server draws from."""

from staleflow.data.datasets import (
    PromptDataset,
    Sample,
    load_dataset,
    load_jsonl,
    load_parquet,
    synthetic_dataset,
)
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
    "PromptSampler",
    "RecordLayout",
    "Sample",
    "Tokenizer",
    "TokenizerError",
    "check",
    "load_dataset",
    "load_jsonl",
    "load_parquet",
    "load_tokenizer",
    "synthetic_dataset",
]
