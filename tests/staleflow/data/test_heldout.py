"""The held-out set (``eval.path``): read by the loaders of the training prompts (format by
the path's name), capped at ``eval.problems``, and refused up front, without a tokenizer,
when it is not there or lacks the prompt or answer column (the message names the columns
it has and the key to set)."""

from __future__ import annotations

import json

import pytest

from staleflow.data import CharTokenizer, DatasetError, RecordLayout
from staleflow.data.heldout import check_heldout_source, heldout_format, load_heldout

TOK = CharTokenizer.from_texts(["abcdefghijklmnopqrstuvwxyz0123456789 ?+=\n"])
ROWS = [{"q": f"what is {i}+1?", "a": str(i + 1), "x": "y"} for i in range(5)]
LAYOUT = RecordLayout("q", "a")


def _jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_format_follows_the_name():
    assert heldout_format("t.jsonl") == heldout_format("t.json") == "jsonl"
    assert heldout_format("t.parquet") == heldout_format("t.pq") == "parquet"
    assert heldout_format("folder") == heldout_format("t-*.arrow") == "hf"


def test_a_jsonl_set_reads_like_the_prompts_and_is_capped(tmp_path):
    path = _jsonl(tmp_path / "test.jsonl")
    full = load_heldout(path, TOK, LAYOUT)
    assert [s.answer for s in full] == ["1", "2", "3", "4", "5"]
    capped = load_heldout(path, TOK, LAYOUT, problems=2)
    assert [s.answer for s in capped] == ["1", "2"]
    assert capped[1].prompt_ids.tolist() == TOK.encode("what is 1+1?", add_bos=True).tolist()
    check_heldout_source(path, LAYOUT, "test")  # there, with its columns: no error


def test_a_missing_set_names_the_path(tmp_path):
    for name in ("absent.jsonl", "absent.parquet", "absent-folder"):
        with pytest.raises(DatasetError, match=rf"{name}: no such file"):
            check_heldout_source(tmp_path / name, LAYOUT, "test")


def test_no_prompt_column_names_the_columns_found_and_the_key(tmp_path):
    path = _jsonl(tmp_path / "test.jsonl")
    with pytest.raises(
        DatasetError,
        match=r"field 'question': no such column \(the prompt column\); the file's columns "
        r"are q, a, x: set data.prompt_column",
    ):
        check_heldout_source(path, RecordLayout("question", "a"), "test")
    with pytest.raises(DatasetError, match=r"no built-in layout matches its keys \(q, a, x\)"):
        check_heldout_source(path, None, "test")  # no columns named: a known layout or nothing


def test_a_parquet_set_is_checked_from_its_schema(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    check_heldout_source(path, LAYOUT, "test")
    assert len(load_heldout(path, TOK, LAYOUT, problems=3)) == 3
    with pytest.raises(DatasetError, match=r"field 'answer': no such column \(the answer"):
        check_heldout_source(path, RecordLayout("q", "answer"), "test")


def test_a_datasets_folder_reads_its_test_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    cols = {k: [r[k] for r in ROWS] for k in ROWS[0]}
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict(cols),
        test=datasets.Dataset.from_dict({k: v[:2] for k, v in cols.items()}),
    ).save_to_disk(str(tmp_path / "dd"))
    check_heldout_source(tmp_path / "dd", LAYOUT, "test")
    assert [s.answer for s in load_heldout(tmp_path / "dd", TOK, LAYOUT)] == ["1", "2"]
    with pytest.raises(DatasetError, match=r"no such column .* set data\.prompt_column"):
        check_heldout_source(tmp_path / "dd", RecordLayout("question", "a"), "test")
