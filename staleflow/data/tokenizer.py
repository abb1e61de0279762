"""Tokenizers that work offline: a character-level one built locally, and an adapter for
a Hugging Face tokenizer directory the user already has on disk.

Both satisfy :class:`Tokenizer`. Token ids are ``np.int32`` arrays.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from staleflow.install import missing

logger = logging.getLogger(__name__)

Message = Mapping[str, str]  # {"role": ..., "content": ...}

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
_FORMAT = "staleflow-char-tokenizer"
_FORMAT_VERSION = 1


class TokenizerError(ValueError):
    """Text or ids the tokenizer cannot handle, or a bad tokenizer file."""


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool = False) -> np.ndarray:
        """1-D int32 ids of ``text``; no special tokens unless ``add_bos``."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special: bool = True) -> str: ...

    def encode_chat(self, messages: Sequence[Message]) -> np.ndarray:
        """Ids of a chat prompt, ready for the assistant's reply."""
        ...


def render_chat(messages: Sequence[Message]) -> str:
    """Plain-text chat rendering for tokenizers without a chat template."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant: "])


class CharTokenizer:
    """One id per character of a fixed alphabet; ids 0, 1, 2 are pad, bos, eos.

    Encoding goes through a code-point lookup table, so it costs a few NumPy operations
    per string rather than a Python loop per character.
    """

    def __init__(self, alphabet: str) -> None:
        chars = list(dict.fromkeys(alphabet))  # keeps first occurrences, in order
        if len(chars) != len(alphabet):
            raise TokenizerError("the alphabet repeats a character; list each one once")
        if not chars:
            raise TokenizerError("the alphabet is empty; build it with CharTokenizer.from_texts")
        self._alphabet = alphabet
        self._id_to_text = [*SPECIAL_TOKENS, *chars]
        codes = np.fromiter(map(ord, chars), dtype=np.int64, count=len(chars))
        self._lut = np.full(int(codes.max()) + 1, -1, dtype=np.int32)
        self._lut[codes] = np.arange(len(SPECIAL_TOKENS), len(self._id_to_text), dtype=np.int32)
        # decoding table: special tokens decode to "" when skipped
        self._plain = np.array(["", "", "", *chars], dtype=object)

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """An alphabet of every character in ``texts``, sorted by code point."""
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls("".join(sorted(seen)))

    @property
    def alphabet(self) -> str:
        return self._alphabet

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_text)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def encode(self, text: str, *, add_bos: bool = False) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        known = codes < len(self._lut)
        ids = np.where(known, self._lut[np.where(known, codes, 0)], -1).astype(np.int32)
        if len(ids) and ids.min() < 0:
            bad = text[int(np.argmax(ids < 0))]
            raise TokenizerError(
                f"character {bad!r} (U+{ord(bad):04X}) is not in the tokenizer's alphabet; "
                "build the tokenizer from your data with CharTokenizer.from_texts(...)"
            )
        if add_bos:
            ids = np.concatenate([np.array([self.bos_id], dtype=np.int32), ids])
        return ids

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special: bool = True) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.ndim != 1:
            raise TokenizerError(f"decode takes a 1-D sequence of ids, got shape {arr.shape}")
        if len(arr) and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise TokenizerError(
                f"id out of range [0, {self.vocab_size}): this tokenizer did not produce it"
            )
        table = self._plain if skip_special else np.array(self._id_to_text, dtype=object)
        return "".join(table[arr].tolist())

    def encode_chat(self, messages: Sequence[Message]) -> np.ndarray:
        return self.encode(render_chat(messages), add_bos=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "special_tokens": list(SPECIAL_TOKENS),
            "alphabet": self._alphabet,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{path}: cannot read a tokenizer file: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise TokenizerError(f"{path}: not a StaleFlow character tokenizer file")
        if data.get("version") != _FORMAT_VERSION:
            raise TokenizerError(
                f"{path}: tokenizer file version {data.get('version')!r}, this StaleFlow reads "
                f"version {_FORMAT_VERSION}; rebuild it with CharTokenizer(...).save()"
            )
        if data.get("special_tokens") != list(SPECIAL_TOKENS):
            raise TokenizerError(f"{path}: special tokens must be {list(SPECIAL_TOKENS)}")
        alphabet = data.get("alphabet")
        if not isinstance(alphabet, str):
            raise TokenizerError(f"{path}: 'alphabet' must be a string")
        return cls(alphabet)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, alphabet={self._alphabet!r})"


class HFTokenizer:
    """Adapter for a Hugging Face tokenizer saved in a local directory (no downloads).

    Needs ``transformers``, imported on construction only.
    """

    def __init__(self, path: str | Path, *, trust_remote_code: bool = False) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                missing("transformers (for HFTokenizer; or use CharTokenizer)", exc)
            ) from exc
        self._path = str(path)
        self._tok = AutoTokenizer.from_pretrained(
            self._path, local_files_only=True, trust_remote_code=trust_remote_code
        )
        if self._tok.eos_token_id is None:
            raise TokenizerError(
                f"the tokenizer in {self._path} defines no eos token; set 'eos_token' in its "
                "tokenizer_config.json"
            )

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return int(self.eos_id if pad is None else pad)  # common practice for causal LMs

    @property
    def bos_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    def encode(self, text: str, *, add_bos: bool = False) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special: bool = True) -> str:
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=skip_special)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template the tokenizer carries, None when it has none."""
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def encode_chat(self, messages: Sequence[Message]) -> np.ndarray:
        if self.chat_template is None:
            return self.encode(render_chat(messages), add_bos=True)
        out = self._tok.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
        )
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # newer versions: a dict
            out = out["input_ids"]
        return np.asarray(out, dtype=np.int32)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text of ``messages`` (and ``tools``, for templates that
        describe them), not tokenised: multi-turn formats cut observations out of it."""
        if not self.has_chat_template:
            raise TokenizerError(f"the tokenizer in {self._path} has no chat template")
        return self._tok.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included (e.g. ``<|im_end|>``)."""
        return self._tok.convert_ids_to_tokens(int(token_id))

    def describe_ids(self, ids: Sequence[int]) -> list[str]:
        """``"<id> '<token>'"`` for each id, saying which are tokens the tokenizer added
        (``added_tokens_decoder``: a class such as Qwen2Tokenizer adds its own specials)."""
        added = self._tok.added_tokens_decoder
        kind = type(self._tok).__name__
        out = []
        for i in ids:
            token = added.get(i)
            if token is None:
                out.append(f"{i} {self._tok.convert_ids_to_tokens(i)!r}")
            else:
                what = "special token" if token.special else "token"
                out.append(f"{i} {token.content!r} (an added {what} of {kind})")
        return out

    def __repr__(self) -> str:
        return f"HFTokenizer({self._path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A saved ``CharTokenizer`` (a .json file) or a Hugging Face tokenizer directory."""
    p = Path(path)
    if p.is_dir():
        return HFTokenizer(p)
    if p.suffix == ".json" and p.is_file():
        return CharTokenizer.load(p)
    raise TokenizerError(
        f"{path}: expected a CharTokenizer .json file or a Hugging Face tokenizer directory"
    )
