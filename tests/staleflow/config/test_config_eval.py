"""The ``eval`` section: its renamed key (``eval_problems``) still reads, with a warning;
a saved config of an earlier run loads as it was."""

from __future__ import annotations

import logging

import pytest

from staleflow.config import (
    ConfigError,
    RunConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)


def test_eval_problems_is_read_as_eval_problems_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="staleflow.config.io"):
        cfg = load_config(None, ["eval_problems=7"])
    assert cfg.eval.problems == 7
    assert "eval_problems is now eval.problems" in caplog.text
    assert "eval_problems" not in config_to_dict(cfg)  # saved under its new name only


def test_both_names_at_once_is_refused():
    with pytest.raises(ConfigError, match=r"eval_problems and eval\.problems are both set"):
        load_config(None, ["eval_problems=7", "eval.problems=8"])


def test_a_config_saved_before_the_rename_loads(tmp_path):
    old = config_to_dict(RunConfig())
    del old["eval"]
    old["eval_problems"] = 64  # what config.yaml of an earlier run holds
    assert config_from_dict(old).eval.problems == 64
    # and a YAML file of it, as `launch --resume` reads one
    save_config(load_config(None, ["eval_problems=32", "eval.every=3"]), tmp_path / "c.yaml")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.eval.problems, cfg.eval.every) == (32, 3)


def test_the_k_of_pass_at_k_defaults_to_the_samples():
    assert load_config(None, ["eval.samples=8"]).eval.k == 8
    assert load_config(None, ["eval.samples=8", "eval.pass_k=2"]).eval.k == 2
