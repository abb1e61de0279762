"""rollout.speculation: off by default, refused where the backend does not verify drafts,
and turned into the embedded engine's setting."""

from __future__ import annotations

import pytest

from staleflow.config import ConfigError, load_config
from staleflow.engines.drafts import SpeculationSettings
from staleflow.runtime.driver.run_plan import control_config
from staleflow.runtime.workers.specs import speculation_settings


def test_off_by_default_and_mapped_to_the_engine_setting() -> None:
    assert speculation_settings(load_config(None, []).rollout.speculation) is None
    cfg = load_config(
        None,
        [
            "rollout.speculation.method=own",
            "rollout.speculation.max_draft=4",
            "rollout.speculation.batch_draft_tokens=16",
            "rollout.speculation.max_ngram=3",
        ],
    )
    s = speculation_settings(cfg.rollout.speculation)
    assert isinstance(s, SpeculationSettings)
    assert (s.drafts.scope, s.drafts.max_ngram, s.max_draft, s.draft_length(8)) == ("own", 3, 4, 2)
    assert not s.window


def test_window_and_race_method_reach_the_engine_and_the_control_plane() -> None:
    assert control_config(load_config(None, [])).race_draft_method is None
    cfg = load_config(None, ["rollout.speculation.method=own", "rollout.speculation.window=true"])
    s = speculation_settings(cfg.rollout.speculation)
    assert s is not None and s.window
    assert control_config(cfg).race_draft_method == "group"  # auto: group for the copies
    cfg = load_config(
        None, ["rollout.speculation.method=own", "rollout.speculation.race_method=same"]
    )
    assert control_config(cfg).race_draft_method is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout.backend=vllm", "rollout.speculation.method=group"], "set it to off"),
        (["rollout.speculation.method=eagle"], "method"),
        (["rollout.speculation.race_method=eagle"], "race_method"),
        (["rollout.speculation.min_ngram=5", "rollout.speculation.max_ngram=3"], "exceeds"),
    ],
)
def test_refused_with_the_fix(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
