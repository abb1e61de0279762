"""How an episode's text becomes tokens: the prompt, and each observation appended to the
response. Token in, token out: the model's own turns are never re-tokenised; only the
prompt and the observations are encoded, here.

:class:`PlainFormat` is the format of tokenizers without a chat template (the built-in
character tokenizer): the prompt is the user's message after a bos, tools are not
described in it (the built-in model learns its one tool from demonstrations), a model
turn ends with eos and an observation is the tool's result in ``<tool_response>`` tags.
:class:`ChatTemplateFormat` is that of a Hugging Face tokenizer with a chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from staleflow.data.datasets import PromptDataset
from staleflow.data.synthetic import ALPHABET
from staleflow.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from staleflow.envs.base import Environment, EnvSample, Episode
from staleflow.envs.tool_calls import format_tool_call, format_tool_response


class TurnFormat(Protocol):
    @property
    def end_of_turn(self) -> int:
        """The token id that ends a model turn (the engine's stop)."""
        ...

    def prompt_ids(self, episode: Episode) -> np.ndarray:
        """1-D int32 ids of the episode's initial messages, ready for the model's turn."""
        ...

    def observation_ids(self, observation: str) -> np.ndarray:
        """1-D int32 ids appended after a model turn (its end-of-turn token included)
        and before the next: the observation and whatever opens the next model turn."""
        ...

    def turn_text(self, token_ids: np.ndarray) -> str:
        """A model turn's text for the environment (special tokens dropped)."""
        ...


@dataclass(frozen=True, slots=True)
class PlainFormat:
    """See the module docstring."""

    tokenizer: Tokenizer

    @property
    def end_of_turn(self) -> int:
        return self.tokenizer.eos_id

    def prompt_ids(self, episode: Episode) -> np.ndarray:
        users = [m["content"] for m in episode.messages if m["role"] == "user"]
        if not users:
            raise ValueError("the episode has no user message to prompt with")
        return self.tokenizer.encode(users[-1], add_bos=True)

    def observation_ids(self, observation: str) -> np.ndarray:
        return self.tokenizer.encode(format_tool_response(observation))

    def turn_text(self, token_ids: np.ndarray) -> str:
        return self.tokenizer.decode(token_ids)


class ChatTemplateFormat:
    """The format of a Hugging Face tokenizer with a chat template (Qwen, Hermes, ...):
    the prompt is the template's rendering of the episode's messages and tools with the
    generation prompt; a model turn ends with the tokenizer's eos (``<|im_end|>`` for Qwen
    instruct models); an observation is what the template puts between that token and
    the next generation prompt around a ``tool`` message (for Qwen:
    ``\n<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>\n<|im_start|>assistant\n``).
    That text is cut from two renderings of a stand-in conversation, so it is exactly
    what the template would render, and tokenised alone: the model's own tokens before
    it are never re-tokenised."""

    _STAND_IN = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        eot = tokenizer.token_text(tokenizer.eos_id)
        before = tokenizer.apply_template(self._STAND_IN, add_generation_prompt=False)
        tool = {"role": "tool", "content": "\x00"}  # a placeholder no template contains
        after = tokenizer.apply_template([*self._STAND_IN, tool], add_generation_prompt=True)
        end = before.rfind(eot)
        if end < 0 or not after.startswith(before[: end + len(eot)]) or after.count("\x00") != 1:
            raise ValueError(
                f"the chat template of {tokenizer!r} does not end an assistant turn with its "
                f"eos token {eot!r} and render a tool message after it; use a tool-calling "
                "instruct model's tokenizer (e.g. Qwen2.5-Instruct) or PlainFormat"
            )
        self._head, _, self._tail = after[end + len(eot) :].partition("\x00")

    @property
    def end_of_turn(self) -> int:
        return self.tokenizer.eos_id

    def prompt_ids(self, episode: Episode) -> np.ndarray:
        text = self.tokenizer.apply_template(episode.messages, tools=episode.tools)
        return self.tokenizer.encode(text)

    def observation_ids(self, observation: str) -> np.ndarray:
        return self.tokenizer.encode(self._head + observation + self._tail)

    def turn_text(self, token_ids: np.ndarray) -> str:
        return self.tokenizer.decode(token_ids)


def turn_format(tokenizer: Tokenizer) -> TurnFormat:
    """The turn format of ``tokenizer``: its chat template's where it has one."""
    if isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template:
        return ChatTemplateFormat(tokenizer)
    return PlainFormat(tokenizer)


def tool_alphabet(*tool_names: str, arguments: Sequence[str] = ()) -> str:
    """The built-in arithmetic alphabet followed by every character that the tool-call and
    tool-response markup of ``tool_names`` and ``arguments`` use (and the lowercase letters,
    so that ``error`` and similar results encode): the arithmetic ids stay as they were."""
    markup = "".join(format_tool_call(n, dict.fromkeys(arguments, "")) for n in tool_names)
    extra = markup + format_tool_response("") + " abcdefghijklmnopqrstuvwxyz"
    return "".join(dict.fromkeys(ALPHABET + extra))


def tool_tokenizer(*tool_names: str, arguments: Sequence[str] = ()) -> CharTokenizer:
    return CharTokenizer(tool_alphabet(*tool_names, arguments=arguments))


def episode_dataset(
    env: Environment, samples: Sequence[EnvSample], fmt: TurnFormat, name: str = ""
) -> PromptDataset:
    """The prompts of ``samples`` for the trajectory server: each prompt is the episode's
    initial messages rendered by ``fmt``, and each ground truth is the sample as JSON
    (:meth:`EnvSample.to_json`), from which the worker that runs the first step starts
    the episode. The prompt is rendered once per sample (seed 0): an environment whose
    first messages depend on the trajectory's seed is not supported yet."""
    prompts = [fmt.prompt_ids(env.start(s, seed=0)) for s in samples]
    answers = [s.to_json() for s in samples]
    return PromptDataset(name or f"{env.name}({len(samples)})", prompts, answers)
