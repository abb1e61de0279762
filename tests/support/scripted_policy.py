"""A policy whose turns are written by a rule, not sampled: the stand-in for a model that
has (or has not) learnt the calculator task, so that an evaluation's score is known
before it runs. It answers ``generate`` as a Hugging Face causal LM does (the new tokens
after the input ids, rows padded with the end-of-turn id), which is all
``staleflow.models.tool_warmup.play_episodes`` asks of a model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from staleflow.data.tokenizer import Tokenizer
from staleflow.envs.calculator import ARGUMENT, TOOL_NAME
from staleflow.envs.tool_calls import RESPONSE_CLOSE, RESPONSE_OPEN, format_tool_call

Rule = Callable[[str], str]  # the episode's text so far (prompt and turns) -> the next turn


def solves(text: str) -> str:
    """Call the calculator with the prompt's expression, then answer what it returned."""
    if RESPONSE_OPEN not in text:
        expression = text.split("=", 1)[0]
        return format_tool_call(TOOL_NAME, {ARGUMENT: expression})
    last = text.rsplit(RESPONSE_OPEN, 1)[1].split(RESPONSE_CLOSE, 1)[0]
    return last


def never_calls(text: str) -> str:
    """Never call the tool: answer at once with the expression itself, which is never a
    problem's answer (a number)."""
    return text.split("=", 1)[0]


class ScriptedPolicy:
    """``generate`` writes ``rule``'s turn and the end-of-turn token for every row."""

    def __init__(self, tokenizer: Tokenizer, rule: Rule) -> None:
        self.tokenizer = tokenizer
        self.rule = rule
        self.training = True
        self.calls = 0

    def eval(self) -> ScriptedPolicy:
        self.training = False
        return self

    def train(self, mode: bool = True) -> ScriptedPolicy:
        self.training = mode
        return self

    def generate(
        self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: Any
    ) -> torch.Tensor:
        self.calls += 1
        eot = int(generation_config.eos_token_id)
        rows = []
        for ids in input_ids.tolist():
            text = self.tokenizer.decode(ids)  # the special tokens (bos, eos) left out
            turn = self.tokenizer.encode(self.rule(text))
            rows.append([*ids, *turn.tolist(), eot])
        width = max(map(len, rows))
        return torch.tensor([r + [eot] * (width - len(r)) for r in rows])
