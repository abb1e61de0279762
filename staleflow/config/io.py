"""Reading, overriding, saving and describing the run configuration.

Precedence: defaults, then the YAML file, then ``key=value`` overrides in order. Values
are read with YAML's scalar rules (``true``, ``4``, ``1.5``, ``null``, ``[...]``) and
then checked against the field's type.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from coordinator.config import ConfigError
from staleflow.config.run import RunConfig, config_warnings
from staleflow.config.walk import ConfigKey, config_keys, from_dict, normalise_key, to_dict

logger = logging.getLogger(__name__)


def parse_override(text: str) -> tuple[str, object, str]:
    """``"rollout.instances=4"`` -> ``("rollout.instances", 4, "4")``: the dotted key,
    the value as YAML reads it, and the raw text (string fields keep it verbatim)."""
    key, sep, raw = text.partition("=")
    key = normalise_key(key)
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {text!r} is not key=value: write e.g. rollout.instances=4 or eta=0"
        )
    raw = raw.strip()
    try:
        value = yaml.safe_load(raw) if raw else None  # "k1=" resets an optional value
    except yaml.YAMLError:
        value = raw  # only a string field can take it; coerce() says so otherwise
    return key, value, raw


def _merge(into: dict[str, Any], data: Mapping[str, Any]) -> None:
    """Deep-merge ``data`` into ``into``: mappings merge, anything else replaces."""
    for raw_key, value in data.items():
        key = normalise_key(raw_key) if isinstance(raw_key, str) else raw_key
        old = into.get(key)
        if isinstance(old, dict) and isinstance(value, Mapping):
            _merge(old, value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {p}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{p} holds a {type(data).__name__}, not a mapping of keys: write e.g. 'eta: 3'"
        )
    return dict(data)


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: RunConfig | None = None,
) -> RunConfig:
    """The validated configuration: ``base`` (default ``RunConfig()``), then the YAML file
    at ``path`` (if any), then the overrides (``"coordinator.routing=vanilla"``).

    Raises :class:`coordinator.config.ConfigError` (a ``ValueError``) naming the key and
    the fix. Valid but doubtful settings are logged as warnings.
    """
    data: dict[str, Any] = {}
    if path is not None:
        _merge(data, _read_yaml(path))
    raw: dict[str, str] = {}
    for text in overrides:
        key, value, raw_text = parse_override(text)
        _merge_override(data, key, value)
        raw[key] = raw_text
    _rename_keys(data, raw)
    config = from_dict(RunConfig, data, base=base or RunConfig(), raw=raw)
    for warning in config_warnings(config):
        logger.warning("config: %s", warning)
    return config


def _merge_override(data: dict[str, Any], key: str, value: object) -> None:
    node: Any = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            section = ".".join(parts[: i + 1])
            raise ConfigError(f"{section} is set to {child!r} and also given keys ({key}=...)")
        node = child
    _merge(node, {parts[-1]: value})


def _rename_keys(data: dict[str, Any], raw: dict[str, str]) -> None:
    """Read a renamed key (``RunConfig.RENAMED_KEYS``) under its new name, with a warning;
    both names at once is an error (which one was meant?)."""
    for old, new in RunConfig.RENAMED_KEYS.items():
        if old not in data:
            continue
        value = data.pop(old)
        node = data
        *sections, leaf = new.split(".")
        for part in sections:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{part} is a section, not a value: set its keys, e.g. {new}=...")
            node = child
        if leaf in node:
            raise ConfigError(
                f"{old} and {new} are both set: {old} is the old name of {new}; drop {old}"
            )
        node[leaf] = value
        if old in raw:
            raw[new] = raw.pop(old)
        logger.warning("config: %s is now %s (read as %s=%r); write %s", old, new, new, value, new)


def config_from_dict(data: Mapping[str, Any], *, base: RunConfig | None = None) -> RunConfig:
    """A :class:`RunConfig` from nested mappings (e.g. a saved run's config), validated."""
    merged: dict[str, Any] = {}
    _merge(merged, data)
    _rename_keys(merged, {})
    return from_dict(RunConfig, merged, base=base or RunConfig())


def config_to_dict(config: object) -> dict[str, Any]:
    """Nested plain dicts of any config section, e.g. for YAML or a run's metadata."""
    return to_dict(config)


def save_config(config: RunConfig, path: str | Path) -> Path:
    """Write ``config`` as YAML that :func:`load_config` reads back to an equal config."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)
    p.write_text("# staleflow run configuration (staleflow.config)\n" + text, encoding="utf-8")
    return p


def describe_config(cls: type = RunConfig) -> list[ConfigKey]:
    """Every key with its type, default and help, in declaration order."""
    return config_keys(cls)


def format_config_help(cls: type = RunConfig) -> str:
    """:func:`describe_config` as aligned text for ``--help`` and docs."""
    keys = describe_config(cls)
    rows = [(k.key, k.type, yaml.safe_dump(k.default).splitlines()[0], k.help) for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [
        f"{key:<{widths[0]}}  {tp:<{widths[1]}}  {default:<{widths[2]}}  {help_}".rstrip()
        for key, tp, default, help_ in rows
    ]
    return "\n".join(lines)
