"""Tokenizers: the character tokenizer offline, and the Hugging Face adapter."""

from __future__ import annotations

import json

import numpy as np
import pytest

from staleflow.data import (
    ALPHABET,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)


def test_char_round_trip_and_special_ids():
    tok = CharTokenizer(ALPHABET)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 3 + len(ALPHABET))
    ids = tok.encode("12+7*3=")
    assert ids.dtype == np.int32 and ids.tolist() == [4, 5, 13, 10, 15, 6, 16]
    assert tok.decode(ids) == "12+7*3="
    with_specials = np.r_[tok.bos_id, ids, tok.eos_id, tok.pad_id]
    assert tok.encode("12+7*3=", add_bos=True).tolist() == with_specials[:-2].tolist()
    assert tok.decode(with_specials) == "12+7*3="
    assert tok.decode(with_specials, skip_special=False) == "<bos>12+7*3=<eos><pad>"
    assert tok.encode("").tolist() == [] and tok.decode([]) == ""
    assert isinstance(tok, Tokenizer)


def test_char_rejects_unknown_text_and_ids():
    tok = CharTokenizer(ALPHABET)
    with pytest.raises(TokenizerError, match=r"'x' \(U\+0078\) is not in the tokenizer's alphabet"):
        tok.encode("1+x")
    with pytest.raises(TokenizerError, match="not in the tokenizer's alphabet"):
        tok.encode("1+\u20ac")  # beyond the lookup table
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([3, tok.vocab_size])
    with pytest.raises(TokenizerError, match="repeats"):
        CharTokenizer("aa")


def test_char_from_texts_handles_unicode_and_chat():
    tok = CharTokenizer.from_texts(["héllo wörld", "user: assistant: \n", "1+1"])
    assert tok.decode(tok.encode("wörld héllo")) == "wörld héllo"
    ids = tok.encode_chat([{"role": "user", "content": "héllo"}])
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == "user: héllo\nassistant: "


def test_char_save_load(tmp_path):
    tok = CharTokenizer.from_texts(["abc 123", "é"])
    path = tmp_path / "tok.json"
    tok.save(path)
    loaded = load_tokenizer(path)
    assert isinstance(loaded, CharTokenizer) and loaded.alphabet == tok.alphabet
    assert loaded.encode("c1é").tolist() == tok.encode("c1é").tolist()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "staleflow-char-tokenizer", "version": 99}))
    with pytest.raises(TokenizerError, match="version 99"):
        CharTokenizer.load(bad)
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        CharTokenizer.load(bad)
    with pytest.raises(TokenizerError, match="expected a CharTokenizer"):
        load_tokenizer(tmp_path / "missing.txt")


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny word-level tokenizer built locally and saved as a Hugging Face directory."""
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4, "world": 5, "42": 6}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    core.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="[UNK]",
    )
    fast.save_pretrained(tmp_path)
    return tmp_path


def test_hf_adapter(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (7, 0, 1, 2)
    ids = tok.encode("hello world 42")
    assert ids.dtype == np.int32 and ids.tolist() == [4, 5, 6]
    assert tok.encode("hello", add_bos=True).tolist() == [1, 4]
    assert tok.decode([1, 4, 5, 2]) == "hello world"
    chat = tok.encode_chat([{"role": "user", "content": "hello"}])  # no template: plain rendering
    assert chat.dtype == np.int32 and chat[0] == 1


def test_hf_adapter_without_transformers_says_how_to_install(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("no transformers here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(
        ImportError, match=r"transformers .*is missing.*-m pip install -c \S*constraints\.txt -e "
    ):
        HFTokenizer(tmp_path)


def test_hf_adapter_uses_the_chat_template(hf_dir):
    config = hf_dir / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}42"
    config.write_text(json.dumps(data))
    (hf_dir / "chat_template.jinja").unlink(missing_ok=True)
    tok = HFTokenizer(hf_dir)
    ids = tok.encode_chat(
        [{"role": "user", "content": "hello"}, {"role": "user", "content": "world"}]
    )
    assert ids.dtype == np.int32 and ids.tolist() == [4, 5, 6]
