"""One generic walker over the configuration dataclasses.

Every operation here (type checks, coercion of parsed YAML values, dicts both ways, the
list of keys) reads the dataclass fields and their annotations, so a new field or section
needs no code here. Supported leaf types: ``bool``, ``int``, ``float``, ``str`` and
``X | None`` of those; a field whose type is a dataclass is a section.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from coordinator.config import ConfigError

# A field's type as typing.get_type_hints returns it: a class (a section or a scalar) or
# an ``X | None`` union. Only compared and split here, so plain ``object``.
Hint: TypeAlias = object

_SCALARS: tuple[type, ...] = (bool, int, float, str)
# PyYAML (YAML 1.1) reads "1e-7" as a string: it wants a dot in a float. Numbers written
# like that are common for learning rates and cost coefficients, so float fields take them.
_FLOAT_TEXT = re.compile(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?")


def is_section(tp: object) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def field_types(cls: type) -> dict[str, Hint]:
    """Resolved annotations of a dataclass's fields, in declaration order."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Hint] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        base, _ = split_optional(tp)
        if not (is_section(base) or base in _SCALARS):
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported config type {tp!r}")
        out[f.name] = tp
    return out


def split_optional(tp: Hint) -> tuple[Hint, bool]:
    """``X | None`` -> ``(X, True)``; ``X`` -> ``(X, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return rest[0], True
        raise TypeError(f"unsupported config type {tp!r}: only X | None unions are allowed")
    return tp, False


def type_name(tp: Hint) -> str:
    base, optional = split_optional(tp)
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    name = names.get(base, "section")
    return f"{name} | None" if optional else name


_EXPECTED = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe_value(value: object) -> str:
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a mapping",
        list: "a list",
        type(None): "null",
    }
    return f"{value!r} ({kinds.get(type(value), 'a ' + type(value).__name__)})"


def matches(value: object, tp: Hint) -> bool:
    """Whether ``value`` is already a valid value of ``tp`` (no conversion)."""
    base, optional = split_optional(tp)
    if value is None:
        return optional
    if is_section(base):
        return isinstance(value, base)
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, base)


def check_types(obj: object, prefix: str) -> None:
    """Raise :class:`ConfigError` naming the first field whose value has the wrong type.

    Sections call this first in ``__post_init__``, so code that builds a config directly
    (not through :func:`from_dict`) gets the same message a YAML file would.
    """
    for name, tp in field_types(type(obj)).items():
        value = getattr(obj, name)
        if not matches(value, tp):
            key = _join(prefix, name)
            base, optional = split_optional(tp)
            expected = base.__name__ if is_section(base) else _EXPECTED[base]
            raise ConfigError(
                f"{key}={_describe_value(value)} has the wrong type: expected {expected}"
                + (" or null" if optional else "")
            )


def numeric_bounds(f: dataclasses.Field) -> tuple[float | None, str, float | None]:
    """``(most, why, least)`` declared in a numeric field's metadata (``max``,
    ``max_why``, ``min``); None where a bound is not declared."""
    return f.metadata.get("max"), str(f.metadata.get("max_why", "")), f.metadata.get("min")


def format_bound(value: float) -> str:
    """A bound as a user would type it: ``604800``, ``2147483647``, ``0.5``, ``1e-06``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def bound_problem(key: str, value: float, f: dataclasses.Field) -> str | None:
    """Why ``value`` is outside the bounds of the numeric field ``f``, with the fix, or
    None. A float must be finite: no key means anything by NaN or an infinity."""
    most, why, least = numeric_bounds(f)
    if isinstance(value, float) and not math.isfinite(value):
        limit = f" up to {format_bound(most)}" if most is not None else ""
        return f"{key}={value!r} is not a number: use a finite one{limit}, e.g. {f.default!r}"
    if most is not None and value > most:
        return f"{key}={value!r} is too large: use at most {format_bound(most)} ({why})"
    if least is not None and value < least:
        return (
            f"{key}={value!r} is too small: use at least {format_bound(least)}, e.g. {f.default!r}"
        )
    return None


def check_bounds(obj: object, prefix: str) -> None:
    """Raise :class:`ConfigError` for the first numeric field of ``obj`` (not of its
    sections) outside its declared bounds."""
    fmap = {f.name: f for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
    for name, tp in field_types(type(obj)).items():
        base, _ = split_optional(tp)
        value = getattr(obj, name)
        if base in (int, float) and matches(value, base):
            problem = bound_problem(_join(prefix, name), value, fmap[name])
            if problem is not None:
                raise ConfigError(problem)


def check_tree_bounds(obj: object, prefix: str = "") -> None:
    """:func:`check_bounds` of ``obj`` and every section under it. The run configuration
    calls it last, so a section's own check (with its more specific message) speaks
    first, and every key is bounded, the coordinator's too."""
    check_bounds(obj, prefix)
    for name in field_types(type(obj)):
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            check_tree_bounds(value, _join(prefix, name))


def coerce(value: object, tp: Hint, key: str, raw: str | None = None) -> object:
    """A parsed (YAML) value as a value of the leaf type ``tp``, or a :class:`ConfigError`.

    ``raw`` is the text of a ``key=value`` override: a string field takes it verbatim when
    YAML read it as something else (``name=2024``, ``address=10:30``).
    """
    base, optional = split_optional(tp)
    if base is str and raw is not None and not isinstance(value, str):
        return raw
    if value is None and optional:
        return None
    if base is float and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        return float(value.replace("_", ""))
    if base is float and matches(value, float):
        return float(value)  # type: ignore[arg-type]
    if matches(value, base):
        return value
    expected = _EXPECTED[base] + (" or null" if optional else "")
    hint = ""
    if base is bool and isinstance(value, int | str):
        hint = "; write true or false"
    elif base is str:
        hint = "; quote it in YAML files"
    elif base is int and isinstance(value, float) and value.is_integer():
        hint = f"; write {int(value)}"
    raise ConfigError(
        f"{key}={_describe_value(value)} has the wrong type: expected {expected}{hint}"
    )


def to_dict(obj: object) -> dict[str, Any]:
    """Nested plain dicts of a config (sections become dicts), in field order."""
    out: dict[str, Any] = {}
    for name in field_types(type(obj)):
        value = getattr(obj, name)
        out[name] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def iter_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, Hint, dataclasses.Field]]:
    """Every leaf key under ``cls`` as ``(dotted key, annotation, field)``, depth first."""
    fmap = {f.name: f for f in dataclasses.fields(cls)}
    for name, tp in field_types(cls).items():
        key = _join(prefix, name)
        base, _ = split_optional(tp)
        if is_section(base):
            yield from iter_keys(base, key)
        else:
            yield key, tp, fmap[name]


@functools.cache
def _all_keys(cls: type) -> tuple[str, ...]:
    keys: list[str] = []
    for key, _tp, _f in iter_keys(cls):
        keys.append(key)
        parent = key.rpartition(".")[0]
        while parent and parent not in keys:  # sections are keys too
            keys.append(parent)
            parent = parent.rpartition(".")[0]
    return tuple(keys)


def suggest(key: str, root: type) -> list[str]:
    """Keys of ``root`` the user probably meant by ``key`` (dotted)."""
    # the key's own sections are where the user already is, not what they meant
    candidates = [c for c in _all_keys(root) if not key.startswith(c + ".")]
    leaf = key.rpartition(".")[2]
    same_leaf = [c for c in candidates if c.rpartition(".")[2] == leaf and c != key]
    scored = sorted(
        ((difflib.SequenceMatcher(None, key, c).ratio(), c) for c in candidates), reverse=True
    )
    # keep the near-best matches only: keys of one section all resemble each other
    best = scored[0][0] if scored else 0.0
    close = [c for ratio, c in scored[:3] if ratio >= max(0.6, best - 0.08)]
    return list(dict.fromkeys([*close, *same_leaf]))[:4]


def _unknown_key(key: str, root: type, siblings: Iterator[str]) -> ConfigError:
    moved = getattr(root, "MOVED_KEYS", {}).get(key)
    if moved:
        return ConfigError(f"{key} is no longer a key: {moved}")
    guesses = suggest(key, root)
    if guesses:
        hint = "did you mean " + " or ".join(repr(g) for g in guesses) + "?"
    else:
        hint = "valid keys here: " + ", ".join(siblings)
    return ConfigError(f"unknown configuration key {key!r}: {hint}")


def normalise_key(key: str) -> str:
    # command lines often spell keys with dashes (--max-running); fields use underscores
    return key.strip().replace("-", "_")


def from_dict(
    cls: type,
    data: Mapping[str, object],
    *,
    base: object | None = None,
    raw: Mapping[str, str] | None = None,
    prefix: str = "",
    root: type | None = None,
) -> Any:
    """Build ``cls`` from nested mappings, on top of ``base`` (default: ``cls()``).

    Keys absent from ``data`` keep ``base``'s values, so a partial section keeps the
    enclosing config's defaults (``RunConfig``'s coordinator default differs from
    ``CoordinatorConfig()``'s). ``raw`` maps dotted keys to override texts (see
    :func:`coerce`). Unknown keys and wrong types raise :class:`ConfigError`; so does the
    validation of each section, innermost first.
    """
    root = root or cls
    raw = raw or {}
    if base is None:
        base = cls()
    types_ = field_types(cls)
    values: dict[str, object] = {}
    for given_key, value in data.items():
        if not isinstance(given_key, str):
            raise ConfigError(
                f"configuration key {given_key!r} under {prefix or 'the top level'} is not a string"
            )
        name = normalise_key(given_key)
        key = _join(prefix, name)
        if name not in types_:
            # "rollouts.instances=4" arrives as {"rollouts": {"instances": 4}}: name the
            # whole key, which finds the intended one better than its first part does
            leaf: object = value
            while isinstance(leaf, Mapping) and len(leaf) == 1:
                ((sub, leaf),) = leaf.items()
                key = f"{key}.{normalise_key(str(sub))}"
            raise _unknown_key(key, root, iter(types_))
        if name in values:
            raise ConfigError(f"{key} is given twice (as {given_key!r} and another spelling)")
        tp = types_[name]
        section, _ = split_optional(tp)
        if is_section(section):
            if value is None:  # "coordinator:" with nothing under it in a YAML file
                value = {}
            if not isinstance(value, Mapping):
                first = next(iter(field_types(section)))
                raise ConfigError(
                    f"{key} is a section, not a value: set its keys, e.g. {key}.{first}=..."
                )
            values[name] = from_dict(
                section, value, base=getattr(base, name), raw=raw, prefix=key, root=root
            )
        else:
            values[name] = coerce(value, tp, key, raw.get(key))
    if not values:
        return base
    merged = {name: values.get(name, getattr(base, name)) for name in types_}
    return cls(**merged)


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One leaf key for ``--help`` and docs."""

    key: str  # dotted, e.g. "rollout.instances"
    type: str  # "int", "float | None", ...
    default: object
    help: str


def config_keys(cls: type, defaults: object | None = None) -> list[ConfigKey]:
    """Every leaf key of ``cls`` with the default it has in ``defaults`` (``cls()``)."""
    defaults = cls() if defaults is None else defaults
    out = []
    for key, tp, f in iter_keys(cls):
        value: object = defaults
        for part in key.split("."):
            value = getattr(value, part)
        text = str(f.metadata.get("help", ""))
        most, why, _ = numeric_bounds(f)
        if most is not None:
            text += f" (at most {format_bound(most)}: {why})"
        out.append(ConfigKey(key, type_name(tp), value, text))
    return out
