"""Hugging Face ``datasets`` sources for real (built locally, nothing downloaded): a
save_to_disk folder, a DatasetDict's split, local Arrow / Parquet / JSON files through
``load_dataset``; column mapping, the error naming the columns a dataset has, and chat
templates with a system prompt on a locally built tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from staleflow.config import ConfigError, load_config, save_config
from staleflow.data import (
    CharTokenizer,
    DatasetError,
    HFTokenizer,
    PromptFormat,
    RecordLayout,
    TokenizerError,
    load_hf_dataset,
)
from staleflow.data.datasets import check_chat_template

datasets = pytest.importorskip("datasets")

TOK = CharTokenizer.from_texts(
    ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ?.:,+-*=#$\n"]
)
ROWS = {
    "problem": ["What is 2+3?", "What is 10*4?"],
    "solution": ["5", "40"],
    "source": ["a", "b"],
}
LAYOUT = RecordLayout("problem", "solution")
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _ids(dataset) -> list[list[int]]:
    return [s.prompt_ids.tolist() for s in dataset]


def _plain() -> list[list[int]]:
    return [TOK.encode(p, add_bos=True).tolist() for p in ROWS["problem"]]


def test_a_save_to_disk_folder_with_mapped_columns(tmp_path):
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "saved"))
    data = load_hf_dataset(tmp_path / "saved", TOK, LAYOUT)
    assert _ids(data) == _plain()
    assert [s.answer for s in data] == ["5", "40"]


def test_a_dataset_dict_folder_reads_the_split_asked_and_names_the_others(tmp_path):
    test_rows = {k: v[:1] for k, v in ROWS.items()}
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict(ROWS), test=datasets.Dataset.from_dict(test_rows)
    ).save_to_disk(str(tmp_path / "dd"))
    assert len(load_hf_dataset(tmp_path / "dd", TOK, LAYOUT)) == 2
    assert len(load_hf_dataset(tmp_path / "dd", TOK, LAYOUT, split="test")) == 1
    with pytest.raises(DatasetError, match="has no split 'validation'; its splits are train, test"):
        load_hf_dataset(tmp_path / "dd", TOK, LAYOUT, split="validation")


@pytest.mark.parametrize("kind", ["parquet", "json", "arrow"])
def test_local_files_are_read_through_load_dataset(tmp_path, kind):
    ds = datasets.Dataset.from_dict(ROWS)
    if kind == "parquet":
        ds.to_parquet(str(tmp_path / "part-0.parquet"))
        path = tmp_path / "part-*.parquet"  # a glob
    elif kind == "json":
        ds.to_json(str(tmp_path / "rows.jsonl"))
        path = tmp_path / "rows.jsonl"
    else:
        ds.save_to_disk(str(tmp_path / "saved"))
        (path,) = (tmp_path / "saved").glob("*.arrow")
    data = load_hf_dataset(path, TOK, LAYOUT)
    assert _ids(data) == _plain() and [s.answer for s in data] == ["5", "40"]


def test_a_missing_prompt_column_names_the_columns_the_dataset_has(tmp_path):
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DatasetError) as err:
        load_hf_dataset(tmp_path / "saved", TOK, RecordLayout("question", "solution"))
    message = str(err.value)
    assert "field 'question': no such column (the prompt column)" in message
    assert "the dataset's columns are problem, solution, source" in message
    assert "set data.prompt_column to one of them" in message
    with pytest.raises(DatasetError, match=r"the answer column.*set data.answer_column"):
        load_hf_dataset(tmp_path / "saved", TOK, RecordLayout("problem", "answer"))


def test_without_columns_a_built_in_layout_is_detected_or_the_keys_are_named(tmp_path):
    gsm = {"question": ["What is 2+3?"], "answer": ["2+3=5\n#### 5"]}
    datasets.Dataset.from_dict(gsm).save_to_disk(str(tmp_path / "gsm"))
    (sample,) = load_hf_dataset(tmp_path / "gsm", TOK)
    assert sample.answer == "5"
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(DatasetError, match="no built-in layout matches its keys"):
        load_hf_dataset(tmp_path / "other", TOK)


def test_a_folder_that_is_not_a_saved_dataset_and_mixed_files_are_refused(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="not one save_to_disk wrote"):
        load_hf_dataset(tmp_path / "plain", TOK, LAYOUT)
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.csv").write_text("x\n")
    with pytest.raises(DatasetError, match="files of one format"):
        load_hf_dataset(tmp_path / "*.*", TOK, LAYOUT)
    with pytest.raises(DatasetError, match="no such file"):
        load_hf_dataset(tmp_path / "none-*.parquet", TOK, LAYOUT)


@pytest.fixture
def chat_tokenizer(tmp_path):
    """A character-level Hugging Face tokenizer built locally, with a small Jinja chat
    template in its tokenizer_config.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("".join(ROWS["problem"]) + "[]\nabcdefghijklmnopqrstuvwxyz"))
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(tmp_path / "tok")
    return HFTokenizer(tmp_path / "tok")


def test_the_chat_template_renders_each_prompt_with_the_system_prompt(tmp_path, chat_tokenizer):
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "saved"))
    fmt = PromptFormat(chat_template=True, system_prompt="be brief")
    data = load_hf_dataset(tmp_path / "saved", chat_tokenizer, LAYOUT, fmt)
    want = [
        chat_tokenizer.encode(f"[system] be brief\n[user] {p}\n[assistant] ").tolist()
        for p in ROWS["problem"]
    ]
    assert _ids(data) == want
    # a chat that brings its own system message keeps it
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert fmt.messages(own) == own
    assert fmt.messages("hi")[0] == {"role": "system", "content": "be brief"}
    # without the template: the text as written, with a bos
    plain = load_hf_dataset(tmp_path / "saved", chat_tokenizer, LAYOUT)
    assert _ids(plain)[0] == [chat_tokenizer.bos_id, *chat_tokenizer.encode(ROWS["problem"][0])]


def test_a_chat_template_asked_of_a_tokenizer_without_one_is_refused():
    with pytest.raises(TokenizerError, match="the tokenizer of /m has no chat template: add one"):
        check_chat_template(TOK, PromptFormat(chat_template=True), "/m")
    check_chat_template(TOK, PromptFormat(), "/m")  # nothing asked, nothing refused
    with pytest.raises(ValueError, match=r"set data\.chat_template=true"):
        PromptFormat(system_prompt="x")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["data.prompt_column=q"], "data.answer_column is not set"),
        (["data.system_prompt=x"], "data.system_prompt='x' needs the chat template"),
        (["data.chat_template=true"], "does not apply to the built-in arithmetic task"),
        (["data.task=hf", "data.path=d"], "model.checkpoint='' is required for data.task=hf"),
    ],
)
def test_the_data_keys_are_checked(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_build_dataset_maps_columns_and_renders_the_template(tmp_path, chat_tokenizer):
    from staleflow.runtime.driver.launch import build_dataset
    from staleflow.runtime.driver.run_plan import plan_run

    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "saved"))
    cfg = load_config(
        None,
        [
            "data.task=hf",
            f"data.path={tmp_path / 'saved'}",
            "data.prompt_column=problem",
            "data.answer_column=solution",
            "data.chat_template=true",
            "model.checkpoint=/m",
        ],
    )
    task = plan_run(cfg).task
    data = build_dataset(task, chat_tokenizer)
    first = chat_tokenizer.encode(f"[user] {ROWS['problem'][0]}\n[assistant] ")
    assert np.array_equal(data[0].prompt_ids, first)
    with pytest.raises(TokenizerError, match="no chat template"):
        build_dataset(task, TOK)
    # the config.yaml a run folder keeps says how its prompts were made
    saved = yaml.safe_load(save_config(cfg, tmp_path / "config.yaml").read_text())["data"]
    assert (saved["chat_template"], saved["prompt_column"]) == (True, "problem")


def test_a_dataset_without_the_prompt_column_stops_launch_before_anything_starts(
    tmp_path, monkeypatch
):
    from staleflow.runtime.driver import launch as driver
    from staleflow.runtime.errors import LaunchError

    def no_cluster(*args, **kwargs):
        raise AssertionError("the launch went on to join a cluster")

    monkeypatch.setattr(driver, "place", no_cluster)
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "m").mkdir()
    cfg = load_config(
        None,
        [
            "data.task=hf",
            f"data.path={tmp_path / 'saved'}",
            "data.prompt_column=question",
            "data.answer_column=solution",
            f"model.checkpoint={tmp_path / 'm'}",
            f"run_dir={tmp_path / 'runs'}",
        ],
    )
    with pytest.raises(LaunchError, match="the dataset's columns are problem, solution, source"):
        driver.launch(cfg)
    assert not (tmp_path / "runs").exists()
