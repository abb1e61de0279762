"""Every numeric key of ``staleflow launch`` has a bound, and an absurd value of any of
them is refused by the configuration, before Ray starts, naming the key and the fix.

``eta=99999999999999999999`` used to pass, start Ray and the actors, and fail 33 s later
with ``OverflowError`` where the staleness manager allocated its rings. The keys are found
by walking the configuration dataclasses, so a key added later is covered (and must
declare its bound) without touching this file. No Ray: ``ray.init`` is replaced by a
function that fails the test if the launcher reaches it.
"""

from __future__ import annotations

import math
import re

import pytest

from staleflow.config import ConfigError, RunConfig, describe_config, load_config
from staleflow.config.walk import format_bound, iter_keys, numeric_bounds, split_optional


def _numeric_keys() -> list[tuple[str, type, object]]:
    out = []
    for key, tp, f in iter_keys(RunConfig):
        base, _ = split_optional(tp)
        if base in (int, float):
            out.append((key, base, f))
    return out


NUMERIC = _numeric_keys()
# what a message that names the fix says: a value or range to use, an example, a change
FIX = re.compile(r"\buse\b|e\.g\.|\braise\b|\blower\b|\bset\b")


def _absurd(base: type, most: float) -> list[object]:
    if base is int:
        return [10**20, int(most) + 1, -(10**20)]
    return [1e300, most * 2 + 1, -1e300, math.nan, math.inf, -math.inf]


def _override(key: str, value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        # YAML spellings of NaN and the infinities, as a user would type them
        return f"{key}=" + {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)]
    return f"{key}={value!r}"


def test_the_walk_finds_the_keys_of_every_section():
    keys = {key for key, _, _ in NUMERIC}
    # one key of each section, the coordinator's nested ones included
    for expected in (
        "eta",
        "model.warmup_steps",
        "data.max_prompt_tokens",
        "rollout.instances",
        "rollout.vllm.gpu_memory_utilization",
        "rollout.sglang.startup_timeout_s",
        "reward.timeout_s",
        "trainer.lr",
        "parameter_server.num_slots",
        "resources.rollout.gpus",
        "resources.placement_timeout_s",
        "recovery.max_restarts",
        "coordinator.mu",
        "coordinator.cost_model.k1",
        "coordinator.seer.chunk_tokens",
        "coordinator.race.copies",
    ):
        assert expected in keys, expected


@pytest.mark.parametrize(("key", "base", "f"), NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_every_numeric_key_declares_its_bound_and_why(key, base, f):
    most, why, _ = numeric_bounds(f)
    assert most is not None, f"{key} declares no bound: give its field metadata a max"
    assert len(why) > 15, f"{key}: say why its bound is {most}"
    # the default is inside it, and --help shows the bound with its reason
    default = RunConfig()
    for part in key.split("."):
        default = getattr(default, part)
    assert default is None or default <= most, key
    help_ = {k.key: k.help for k in describe_config()}
    assert f"at most {format_bound(most)}: {why}" in help_[key], key


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher reached ray.init with a value it should refuse")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.mark.parametrize(("key", "base", "f"), NUMERIC, ids=[k for k, _, _ in NUMERIC])
def test_an_absurd_value_is_refused_before_ray_starts(key, base, f, no_ray, capsys):
    from staleflow.cli import main

    most, _, _ = numeric_bounds(f)
    assert most is not None
    for value in _absurd(base, most):
        with pytest.raises(ConfigError) as err:
            load_config(None, [_override(key, value)])
        message = str(err.value)
        assert key in message, (value, message)
        # the fix: a value to use instead (a range, a bound, or an example)
        assert FIX.search(message), (value, message)
    # the launcher itself: refused with exit 2 and the message, and no Ray
    value = _absurd(base, most)[0]
    assert main(["launch", "--no-dashboard", _override(key, value)]) == 2
    err = capsys.readouterr().err
    assert key in err and FIX.search(err), err


def test_the_eta_of_the_report_is_refused_with_the_managers_reason(no_ray, capsys):
    from staleflow.cli import main

    assert main(["launch", "eta=99999999999999999999", "steps=2"]) == 2
    err = capsys.readouterr().err
    assert "eta=99999999999999999999 is too large: use at most 1024" in err
    assert "O(eta)" in err  # why: what the staleness manager can hold
