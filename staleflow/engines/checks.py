"""Checks every engine applies to what it is given: requests at ``submit`` and weights at
``load_weights``. One definition, so every backend refuses the same input with the same
message, naming the trajectory or the parameter, before anything changes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from staleflow.engines.base import EngineOutput, GenerationRequest
from staleflow.engines.drafts import METHODS


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request whose arrays have the contract's dtypes (copies, owned by the engine)."""

    traj_id: int
    prompt: np.ndarray  # int32
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    versions: np.ndarray  # int32
    max_response: int
    group_id: int | None = None
    draft_method: str | None = None


class RequestRecord:
    """A trajectory inside an engine: its response grows as Python lists (cheap appends per
    step) and becomes arrays only when it leaves (:meth:`output`). Engines subclass it with
    their own bookkeeping slots."""

    __slots__ = ("logprobs", "max_response", "prompt", "tokens", "traj_id", "versions")

    def __init__(self, req: CheckedRequest) -> None:
        self.traj_id = req.traj_id
        self.prompt = req.prompt
        self.tokens: list[int] = req.tokens.tolist()
        self.logprobs: list[float] = req.logprobs.tolist()
        self.versions: list[int] = req.versions.tolist()
        self.max_response = req.max_response

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def output(self, finish_reason: str | None) -> EngineOutput:
        return EngineOutput(
            traj_id=self.traj_id,
            tokens=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            finish_reason=finish_reason,
        )


def check_request(req: GenerationRequest, *, vocab_size: int, max_seq_len: int) -> CheckedRequest:
    """Raise ``ValueError`` naming the trajectory for a malformed request."""
    traj_id = req.traj_id
    if not isinstance(traj_id, int | np.integer) or isinstance(traj_id, bool):
        raise ValueError(f"trajectory {traj_id!r}: traj_id must be an int")
    where = f"trajectory {traj_id}"
    prompt = _ids(req.prompt, f"{where}: prompt", vocab_size)
    tokens = _ids(req.tokens, f"{where}: tokens", vocab_size)
    if len(prompt) == 0:
        raise ValueError(f"{where}: empty prompt; give at least one token")
    logprobs = _array(req.logprobs, f"{where}: logprobs", "f")
    versions = _array(req.versions, f"{where}: versions", "iu")
    if not len(tokens) == len(logprobs) == len(versions):
        raise ValueError(
            f"{where}: tokens, logprobs and versions must have one entry per token, got "
            f"lengths {len(tokens)}, {len(logprobs)}, {len(versions)}"
        )
    max_response = req.max_response
    if not isinstance(max_response, int | np.integer) or max_response < 1:
        raise ValueError(f"{where}: max_response must be a positive int, got {max_response!r}")
    if len(tokens) >= max_response:
        raise ValueError(
            f"{where}: the response already has {len(tokens)} tokens, max_response is "
            f"{max_response}; it is finished, do not resubmit it"
        )
    if len(prompt) + max_response > max_seq_len:
        raise ValueError(
            f"{where}: prompt ({len(prompt)}) + max_response ({max_response}) exceeds "
            f"max_seq_len={max_seq_len}; shorten the request or raise max_seq_len"
        )
    group_id = req.group_id
    if group_id is not None and (
        not isinstance(group_id, int | np.integer) or isinstance(group_id, bool) or group_id < 0
    ):
        raise ValueError(f"{where}: group_id must be a non-negative int or None, got {group_id!r}")
    method = req.draft_method
    if method is not None and method not in METHODS:
        raise ValueError(f"{where}: draft_method must be one of {METHODS} or None, got {method!r}")
    return CheckedRequest(
        traj_id=int(traj_id),
        prompt=prompt,
        tokens=tokens,
        logprobs=logprobs.astype(np.float32, copy=True),
        versions=versions.astype(np.int32, copy=True),
        max_response=int(max_response),
        group_id=None if req.group_id is None else int(req.group_id),
        draft_method=method,
    )


def check_unique(requests: list[CheckedRequest], known: object) -> None:
    """Refuse ids already in the engine (``known`` supports ``in``) or repeated in the call."""
    seen: set[int] = set()
    for r in requests:
        if r.traj_id in known or r.traj_id in seen:  # type: ignore[operator]
            raise ValueError(f"trajectory {r.traj_id}: already in the engine (duplicate id)")
        seen.add(r.traj_id)


def check_weights(
    expected: Mapping[str, tuple[int, ...]], weights: Mapping[str, object]
) -> dict[str, object]:
    """``weights`` checked against ``expected`` (name -> shape): every name present, none
    unknown, shapes equal, floating dtypes. Returns the values by name (numpy arrays or
    tensors, unconverted). Raises ``ValueError`` naming the parameter."""
    extra = [n for n in weights if n not in expected]
    if extra:
        raise ValueError(
            f"unknown parameter {extra[0]!r} (and {len(extra) - 1} more); expected the "
            "names of weight_shapes()"
        )
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(
            f"parameter {missing[0]!r} is missing (and {len(missing) - 1} more); "
            "load_weights takes every parameter of weight_shapes()"
        )
    out: dict[str, object] = {}
    for name, value in weights.items():
        shape = getattr(value, "shape", None)
        if shape is None or not hasattr(value, "dtype"):
            raise ValueError(
                f"parameter {name!r}: expected a numpy array or tensor, got {type(value).__name__}"
            )
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(
                f"parameter {name!r}: shape {tuple(shape)}, expected {tuple(expected[name])}"
            )
        if not _is_float(value):
            raise ValueError(f"parameter {name!r}: dtype {value.dtype} is not a floating type")  # type: ignore[attr-defined]
        out[name] = value
    return out


def _is_float(value: object) -> bool:
    dtype = value.dtype  # type: ignore[attr-defined]
    if isinstance(dtype, np.dtype):
        return dtype.kind == "f"
    return bool(getattr(dtype, "is_floating_point", False))


def _array(values: object, what: str, kinds: str) -> np.ndarray:
    if not isinstance(values, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(values).__name__}")
    if values.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {values.shape}")
    if values.size and values.dtype.kind not in kinds:
        raise ValueError(
            f"{what} has dtype {values.dtype}; expected {'floats' if kinds == 'f' else 'integers'}"
        )
    return values


def _ids(values: object, what: str, vocab: int) -> np.ndarray:
    arr = _array(values, what, "iu")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise ValueError(f"{what} has token ids outside [0, {vocab}) of the model's vocabulary")
    return arr.astype(np.int32, copy=True)
