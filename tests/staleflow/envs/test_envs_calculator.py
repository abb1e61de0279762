"""The built-in agentic task: tool-call parsing, the calculator, its keyed latency, the
episode and its score, the prompts and the warm-up demonstrations."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from staleflow.data.synthetic import ALPHABET, ArithmeticConfig
from staleflow.data.tokenizer import CharTokenizer
from staleflow.envs import (
    EnvSample,
    EpisodeLimits,
    ModelTurn,
    after_step,
    check_plain,
    make_environment,
)
from staleflow.envs.calculator import (
    CalculatorEnvironment,
    CalculatorError,
    calculate,
    calculator_samples,
    calculator_tokenizer,
    demonstration,
    pareto_latency,
)
from staleflow.envs.formats import PlainFormat, episode_dataset
from staleflow.envs.tool_calls import (
    ToolCallError,
    format_tool_call,
    format_tool_response,
    parse_tool_calls,
)

CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"12+7*3"}}</tool_call>'


def _turn(text: str, index: int = 0) -> ModelTurn:
    return ModelTurn(index, text, np.zeros(1, dtype=np.int32))


# -- tool calls ---------------------------------------------------------------------------


def test_parser_reads_the_hermes_format_and_what_models_write_around_it() -> None:
    (call,) = parse_tool_calls(CALL)
    assert (call.name, dict(call.arguments)) == ("calculator", {"expression": "12+7*3"})
    loose = (
        'let me compute <tool_call>\n {"name": "calculator", "arguments": {"expression": "1+2"}}\n'
    )
    assert parse_tool_calls(loose)[0].arguments == {"expression": "1+2"}  # unclosed at the end
    as_string = (
        '<tool_call>{"name":"calculator","arguments":"{\\"expression\\":\\"3\\"}"}</tool_call>'
    )
    assert parse_tool_calls(as_string)[0].arguments == {"expression": "3"}
    assert len(parse_tool_calls(CALL + " and " + CALL)) == 2
    assert parse_tool_calls("33") == []
    assert (
        parse_tool_calls(format_tool_call("calculator", {"expression": "5"}))[0].name
        == "calculator"
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<tool_call>{name: calculator}</tool_call>", "not valid JSON"),
        ("<tool_call></tool_call>", "is empty"),
        ("<tool_call>[1, 2]</tool_call>", "JSON list, not an object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "arguments is a list"),
        ('<tool_call>{"name": "c", "arguments": "{oops"}</tool_call>', "string that is not JSON"),
        (
            '<tool_call>{"name": "c"} <tool_call>{"name": "d"}</tool_call>',
            "opens <tool_call> again",
        ),
        ("33</tool_call>", "without a <tool_call>"),
    ],
)
def test_parser_says_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ToolCallError, match=why):
        parse_tool_calls(text)


# -- the calculator -----------------------------------------------------------------------


def test_calculate_follows_precedence_and_refuses_what_it_cannot_read() -> None:
    assert calculate("12+7*3") == "33"
    assert calculate(" 5 - 9 ") == "-4"
    for bad, why in [("", "empty"), ("2+", "ends in an operator"), ("2/3", "at '/'"),
                     ("9" * 65, "at most 64")]:  # fmt: skip
        with pytest.raises(CalculatorError, match=why):
            calculate(bad)


def test_latency_is_heavy_tailed_capped_and_keyed() -> None:
    assert pareto_latency(0.5, 0.0, 1.5, 5.0) == 0.0
    assert pareto_latency(1.0 - 1e-12, 0.1, 1.5, 5.0) == pytest.approx(0.1)
    assert pareto_latency(1e-9, 0.1, 1.5, 5.0) == 5.0  # the cap
    env = CalculatorEnvironment(latency_scale_s=0.1, latency_shape=1.5, latency_cap_s=100.0)
    lat = []
    for seed in range(400):
        ep = env.start(EnvSample(0, "1+2=", "3"), seed=seed)
        lat.append(env.step(ep.state, _turn(CALL)).latency_s)
    again = env.start(EnvSample(0, "1+2=", "3"), seed=7)
    assert env.step(again.state, _turn(CALL)).latency_s == lat[7]  # a resume waits as long
    lat_arr = np.array(lat)
    assert lat_arr.min() >= 0.1
    # heavy tail: the mean sits well above the median, and some calls take 5x the scale
    assert lat_arr.mean() > 1.3 * np.median(lat_arr) and (lat_arr > 0.5).any()


def test_an_episode_calls_the_tool_then_answers() -> None:
    env = make_environment("calculator", latency_scale_s=0.0)
    ep = env.start(EnvSample(3, "12+7*3=", "33"), seed=5)
    assert ep.messages[-1] == {"role": "user", "content": "12+7*3="}
    assert ep.tools[0]["function"]["name"] == "calculator"
    check_plain(ep.state)
    first = env.step(ep.state, _turn(CALL, 0))
    assert (first.observation, first.done, first.error) == ("33", False, "")
    state = msgpack.unpackb(msgpack.packb(first.state))  # it travels with the trajectory
    last = env.step(state, _turn("12+21=33", 1))
    assert last.done and env.score(last.state) == 1.0
    assert env.score(env.step(state, _turn("34", 1)).state) == 0.0
    assert (last.state["tool_calls"], last.state["tool_errors"]) == (1, 0)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "<tool_call>{oops}</tool_call>",
            "turn 0: malformed tool call: tool call 1 is not valid JSON",
        ),
        ('<tool_call>{"name":"search","arguments":{}}</tool_call>', "unknown tool 'search'"),
        ('<tool_call>{"name":"calculator","arguments":{"x":"1"}}</tool_call>', "'expression'"),
        ('<tool_call>{"name":"calculator","arguments":{"expression":"1/0"}}</tool_call>', "at '/'"),
    ],
)
def test_a_bad_call_is_the_trajectorys_error_and_the_episode_goes_on(text: str, error: str) -> None:
    env = CalculatorEnvironment(latency_scale_s=0.0)
    ep = env.start(EnvSample(0, "1+2=", "3"), seed=0)
    step = env.step(ep.state, _turn(text))
    assert error in step.error and step.observation == "error" and not step.done
    assert step.state["tool_errors"] == 1 and step.info["tool_errors"] == 1


def test_limits_end_a_looping_model_the_one_way() -> None:
    env = CalculatorEnvironment(latency_scale_s=0.0)
    fmt = PlainFormat(calculator_tokenizer())
    limits = EpisodeLimits(max_turns=3, max_tokens=10_000)
    state, tokens, finish, turns = env.start(EnvSample(0, "1+2=", "3"), 0).state, 0, "", 0
    while not finish:
        step = env.step(state, _turn(CALL, turns))
        turns += 1
        obs = fmt.observation_ids(step.observation)
        verdict = after_step(limits, turns_done=turns, response_tokens=tokens, step=step,
                             observation_ids=obs)  # fmt: skip
        state, tokens, finish = step.state, tokens + len(obs), verdict.finish
    assert (finish, turns, env.score(state)) == ("max_turns", 3, 0.0)


# -- prompts and demonstrations -----------------------------------------------------------


def test_the_tokenizer_keeps_the_arithmetic_ids_and_encodes_the_markup() -> None:
    # the built-in arithmetic model's tokenizer (staleflow.models.build, which needs torch)
    tok, arith = calculator_tokenizer(), CharTokenizer(ALPHABET)
    assert tok.encode("12+7*3=").tolist() == arith.encode("12+7*3=").tolist()
    for text in (CALL, format_tool_response("-33"), format_tool_response("error")):
        assert tok.decode(tok.encode(text)) == text


def test_the_dataset_carries_the_sample_and_the_demonstration_masks_the_observation() -> None:
    tok = calculator_tokenizer()
    fmt = PlainFormat(tok)
    samples = calculator_samples(ArithmeticConfig.level(3, seed=1), size=20)
    ds = episode_dataset(CalculatorEnvironment(), samples, fmt)
    assert len(ds) == 20
    assert EnvSample.from_json(ds[4].answer) == samples[4]
    assert tok.decode(ds[4].prompt_ids) == samples[4].prompt
    demo = demonstration(samples[4], fmt, tok)
    assert demo.prompt.tolist() == ds[4].prompt_ids.tolist()
    assert len(demo.mask) == len(demo.response)
    # trained: the call and its eos, the answer and its eos; not: the observation
    eos = np.flatnonzero(demo.response == tok.eos_id)
    assert len(eos) == 2 and demo.mask[eos].all()
    observed = tok.decode(demo.response[~demo.mask])
    assert observed == format_tool_response(samples[4].answer)
    trained = tok.decode(demo.response[demo.mask])
    assert (
        json.loads(trained.split("<tool_call>")[1].split("</tool_call>")[0])["name"] == "calculator"
    )
    assert trained.endswith(samples[4].answer)
    # the demonstration scores 1 when played through the environment
    env = CalculatorEnvironment(latency_scale_s=0.0)
    ep = env.start(samples[4], seed=0)
    first_turn = demo.response[: eos[0] + 1]
    step = env.step(ep.state, ModelTurn(0, fmt.turn_text(first_turn), first_turn))
    second_turn = demo.response[len(first_turn) + (~demo.mask).sum() :]
    end = env.step(step.state, ModelTurn(1, fmt.turn_text(second_turn), second_turn))
    assert end.done and env.score(end.state) == 1.0


def test_a_sample_that_is_not_json_says_how_to_fix_it() -> None:
    from staleflow.envs import EnvContractError

    with pytest.raises(EnvContractError, match=r"data\.task must name the environment"):
        EnvSample.from_json("33")
