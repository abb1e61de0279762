"""The turn format of a Hugging Face tokenizer with a chat template: the prompt renders
the messages and the tool schemas, and an observation is exactly the text the template
puts after the model's end-of-turn token around a tool message, tokenised alone."""

from __future__ import annotations

import numpy as np
import pytest

from staleflow.envs import EnvSample
from staleflow.envs.calculator import CalculatorEnvironment
from staleflow.envs.formats import ChatTemplateFormat, PlainFormat, turn_format

# A Qwen2.5-like template, shortened: tools in a system turn, a tool message as a user
# turn in <tool_response> tags, <|im_end|> ending every turn.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content }}\nTools: "
    "{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif not (tools and m.role == 'system') %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def qwen_like(tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from staleflow.data.tokenizer import HFTokenizer

    core = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    core.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(["<tool_call>calculator 12+7*3=33 </tool_response>"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(tmp_path)
    return HFTokenizer(tmp_path)


def test_prompt_and_observation_come_from_the_template(qwen_like) -> None:
    fmt = turn_format(qwen_like)
    assert isinstance(fmt, ChatTemplateFormat) and fmt.end_of_turn == qwen_like.eos_id
    env = CalculatorEnvironment(latency_scale_s=0)
    episode = env.start(EnvSample(0, "12+7*3=", "33"), seed=0)
    prompt = qwen_like.decode(fmt.prompt_ids(episode), skip_special=False)
    assert prompt.startswith("<|im_start|>system\nSolve") and "Tools: calculator" in prompt
    assert prompt.endswith("<|im_start|>user\n12+7*3=<|im_end|>\n<|im_start|>assistant\n")
    # a whole conversation rendered by the template equals the prompt, the model's turn
    # (as generated, ending at <|im_end|>) and the observation, concatenated
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"12+7*3"}}</tool_call>'
    turn = np.append(qwen_like.encode(call), qwen_like.eos_id)
    obs = fmt.observation_ids("33")
    whole = qwen_like.apply_template(
        [
            *episode.messages,
            {"role": "assistant", "content": call},
            {"role": "tool", "content": "33"},
        ],
        tools=episode.tools,
    )
    got = np.concatenate([fmt.prompt_ids(episode), turn, obs])
    assert qwen_like.decode(got, skip_special=False) == whole
    assert fmt.turn_text(turn) == call


def test_a_tokenizer_without_a_template_gets_the_plain_format(qwen_like) -> None:
    from staleflow.envs.calculator import calculator_tokenizer

    assert isinstance(turn_format(calculator_tokenizer()), PlainFormat)
    qwen_like._tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="does not end an assistant turn"):
        ChatTemplateFormat(qwen_like)
