"""Dataset sources: JSONL and Parquet in the GSM8K and DAPO-Math layouts, malformed rows,
the synthetic dataset, and deterministic sampling."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from staleflow.data import (
    ALPHABET,
    ArithmeticConfig,
    CharTokenizer,
    DatasetError,
    PromptSampler,
    RecordLayout,
    load_dataset,
    load_jsonl,
    load_parquet,
    synthetic_dataset,
)
from trajectory_server import PromptSource, SampleLike

TOK = CharTokenizer.from_texts(
    ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ?.:,+-*=#$\n"]
)

GSM8K_ROWS = [
    {"question": "What is 2+3?", "answer": "2+3=5.\n#### 5"},
    {"question": "What is 10*4?", "answer": "It is 40. #### 40 "},
]
DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "Solve 1+1."}],
        "reward_model": {"ground_truth": "2", "style": "rule-lm"},
    },
    {"prompt": "Solve 3*3.", "reward_model": {"ground_truth": "9"}},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(params=["jsonl", "parquet"])
def write(request):
    return write_jsonl if request.param == "jsonl" else write_parquet


def test_gsm8k_layout_is_detected(tmp_path, write):
    path = write(tmp_path / f"gsm8k.{'jsonl' if write is write_jsonl else 'parquet'}", GSM8K_ROWS)
    ds = load_dataset(path, TOK)
    assert len(ds) == 2 and [s.answer for s in ds] == ["5", "40"]
    first = ds[0]
    assert first.sample_id == 0 and first.prompt_ids.dtype == np.int32
    assert first.prompt_ids[0] == TOK.bos_id and TOK.decode(first.prompt_ids) == "What is 2+3?"
    assert ds.prompt_lengths.tolist() == [13, 14]


def test_dapo_layout_with_chat_and_string_prompts(tmp_path, write):
    # a Parquet column has one type: the string-prompt row goes in the JSONL case only
    rows = DAPO_ROWS if write is write_jsonl else [DAPO_ROWS[0], DAPO_ROWS[0]]
    path = write(tmp_path / f"dapo.{'jsonl' if write is write_jsonl else 'parquet'}", rows)
    ds = load_dataset(path, TOK)
    assert TOK.decode(ds[0].prompt_ids) == "user: Solve 1+1.\nassistant: "
    assert ds[0].answer == "2"
    if write is write_jsonl:
        assert TOK.decode(ds[1].prompt_ids) == "Solve 3*3." and ds[1].answer == "9"


def test_custom_layout_with_dotted_paths_and_numbers(tmp_path):
    rows = [{"q": {"text": "a?"}, "meta.sol": 12}, {"q": {"text": "b?"}, "meta.sol": 1.5}]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    ds = load_jsonl(path, TOK, RecordLayout(prompt_field="q.text", answer_field="meta.sol"))
    assert [s.answer for s in ds] == ["12", "1.5"]


def expect_error(path, row, field, match, layout=None):
    with pytest.raises(DatasetError, match=match) as info:
        load_dataset(path, TOK, layout)
    err = info.value
    assert (err.path, err.row, err.field) == (str(path), row, field)
    assert str(path) in str(err)
    if row is not None:
        assert f"row {row}" in str(err)
    if field is not None:
        assert repr(field) in str(err)
    return err


@pytest.mark.parametrize(
    ("bad_row", "field", "match"),
    [
        ({"question": "q?"}, "answer", "missing .*row has keys: question"),
        ({"question": "q?", "answer": "no marker"}, "answer", "no '####' marker"),
        ({"question": 7, "answer": "#### 1"}, "question", "string or a list of chat messages, got int"),
        ({"question": "q?", "answer": ["#### 1"]}, "answer", "string or a number, got list"),
        ({"question": "q?", "answer": None}, "answer", "string or a number, got NoneType"),
        ({"question": "  ", "answer": "#### 1"}, "question", "is empty"),
        ({"question": "q~", "answer": "#### 1"}, "question", "not in the tokenizer's alphabet"),
    ],
)  # fmt: skip
def test_malformed_gsm8k_rows_name_file_row_and_field(tmp_path, bad_row, field, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [GSM8K_ROWS[0], GSM8K_ROWS[1], bad_row])
    expect_error(path, 3, field, match)


@pytest.mark.parametrize(
    ("bad_row", "field", "match"),
    [
        ({"prompt": "p", "reward_model": {}}, "reward_model.ground_truth", "missing"),
        ({"prompt": "p", "reward_model": {"ground_truth": True}}, "reward_model.ground_truth", "got bool"),
        ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}, "prompt", "message 0"),
        ({"prompt": [], "reward_model": {"ground_truth": "1"}}, "prompt", "empty chat"),
    ],
)  # fmt: skip
def test_malformed_dapo_rows_name_file_row_and_field(tmp_path, bad_row, field, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [DAPO_ROWS[0], bad_row])
    expect_error(path, 2, field, match)


def test_bad_json_line_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n\n" + '{"question": "x", \n')
    expect_error(path, 3, None, "not valid JSON")
    path.write_text(json.dumps(GSM8K_ROWS[0]) + "\n[1, 2]\n")
    expect_error(path, 2, None, "must be a JSON object, got list")


def test_malformed_parquet_row(tmp_path):
    rows = [{"question": "q?", "answer": "#### 1"}, {"question": "q?", "answer": None}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    expect_error(path, 2, "answer", "got NoneType")


def test_unknown_layout_and_files(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"input": "a", "output": "b"}])
    err = expect_error(path, 1, None, "no built-in layout matches its keys \\(input, output\\)")
    assert "RecordLayout(prompt_field=" in str(err)
    expect_error(write_jsonl(tmp_path / "empty.jsonl", []), None, None, "has no rows")
    expect_error(tmp_path / "absent.jsonl", None, None, "cannot be read")
    expect_error(tmp_path / "data.csv", None, None, "unknown format")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    expect_error(tmp_path / "broken.parquet", None, None, "cannot be read as Parquet")
    pickled = pickle.loads(pickle.dumps(DatasetError("f", 2, "x", "bad")))
    assert (pickled.row, str(pickled)) == (2, "f, row 2, field 'x': bad")


def test_parquet_with_explicit_layout(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"p": "a b", "s": {"gt": "3"}}])
    ds = load_parquet(path, TOK, RecordLayout("p", "s.gt"))
    assert ds[0].answer == "3" and TOK.decode(ds[0].prompt_ids) == "a b"


def test_synthetic_dataset_is_a_prompt_source_for_the_ts():
    tok = CharTokenizer(ALPHABET)
    ds = synthetic_dataset(tok, ArithmeticConfig(seed=1), size=100)
    assert len(ds) == 100 and isinstance(ds[0], SampleLike)
    assert tok.decode(ds[0].prompt_ids).endswith("=")
    assert ds[-1].sample_id == 99 and ds[10:12][1].sample_id == 11
    with pytest.raises(IndexError, match="out of range"):
        ds[100]
    again = synthetic_dataset(tok, ArithmeticConfig(seed=1), size=100)
    assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(ds, again, strict=True))
    assert not ds[0].prompt_ids.flags.writeable
    assert isinstance(PromptSampler(ds), PromptSource)


def test_sampler_is_deterministic_and_reshuffles_each_epoch():
    ds = synthetic_dataset(CharTokenizer(ALPHABET), size=20)

    def draw(sampler, n):
        return [sampler.next_sample().sample_id for _ in range(n)]

    a = draw(PromptSampler(ds, seed=5), 60)
    assert a == draw(PromptSampler(ds, seed=5), 60)
    assert a != draw(PromptSampler(ds, seed=6), 60)
    epochs = [a[0:20], a[20:40], a[40:60]]
    assert all(sorted(e) == list(range(20)) for e in epochs)  # each epoch covers all once
    assert epochs[0] != epochs[1] != epochs[2]
    resumed = PromptSampler(ds, seed=5, start=33)
    assert draw(resumed, 27) == a[33:] and resumed.drawn == 60 and resumed.epoch == 3
    assert draw(PromptSampler(ds, shuffle=False), 3) == [0, 1, 2]


def test_sampler_stops_after_max_epochs():
    ds = synthetic_dataset(CharTokenizer(ALPHABET), size=3)
    sampler = PromptSampler(ds, max_epochs=2)
    assert [sampler.next_sample() is not None for _ in range(6)] == [True] * 6
    assert sampler.next_sample() is None and sampler.next_sample() is None
    with pytest.raises(ValueError, match="max_epochs"):
        PromptSampler(ds, max_epochs=0)
