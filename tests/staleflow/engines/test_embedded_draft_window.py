"""The per-request draft window (``staleflow.engines.embedded.draft_window``): halved on a
rejection but not below what was accepted plus one, doubled on a draft accepted whole,
within ``min_window`` and ``max_draft``; and the speculator applies it on top of the batch
rule."""

from __future__ import annotations

import numpy as np
import pytest

from staleflow.engines.drafts import DraftSettings, SpeculationSettings
from staleflow.engines.embedded.draft_window import DraftWindow
from staleflow.engines.embedded.speculator import Speculator


def test_window_shrinks_on_rejections_and_grows_back_on_full_acceptance() -> None:
    w = DraftWindow(SpeculationSettings(max_draft=8, window=True))
    assert w.limit(1) == 8  # a new request starts at max_draft
    w.update(1, drafted=8, accepted=0)
    assert w.limit(1) == 4
    w.update(1, drafted=4, accepted=0)
    w.update(1, drafted=2, accepted=0)
    w.update(1, drafted=1, accepted=0)
    assert w.limit(1) == 1  # min_window
    w.update(1, drafted=1, accepted=1)
    w.update(1, drafted=2, accepted=2)
    assert w.limit(1) == 4
    w.update(1, drafted=4, accepted=4)
    w.update(1, drafted=8, accepted=8)
    assert w.limit(1) == 8  # capped at max_draft
    w.update(1, drafted=8, accepted=6)  # most held: keep what held plus one
    assert w.limit(1) == 7
    w.update(1, drafted=0, accepted=0)  # no draft verified: no news
    assert w.limit(1) == 7
    assert w.shrinks == 4  # 8 -> 4 -> 2 -> 1, then 8 -> 7 (1 stays 1)
    w.forget(1)
    assert w.limit(1) == 8 and len(w) == 0
    floor = DraftWindow(SpeculationSettings(max_draft=8, window=True, min_window=3))
    for _ in range(4):
        floor.update(2, drafted=8, accepted=0)
    assert floor.limit(2) == 3


def test_min_window_is_checked() -> None:
    with pytest.raises(ValueError, match="min_window"):
        SpeculationSettings(max_draft=4, min_window=5)


def test_speculator_drafts_within_the_window_and_the_batch_rule() -> None:
    settings = SpeculationSettings(
        drafts=DraftSettings(scope="own", min_ngram=1, max_ngram=2),
        max_draft=8,
        batch_draft_tokens=32,
        window=True,
    )
    s = Speculator(settings)
    # a response that repeats itself: its own history drafts as long as allowed
    s.add(1, None, np.array([5, 6], np.int32), [1, 2, 3] * 8, None)
    assert len(s.drafts([(1, 100)], spare=100)[0]) == 8
    s.record([1], [[1] * 8], [[(9, 0.0)]])  # rejected at once: halved
    assert len(s.drafts([(1, 100)], spare=100)[0]) == 4
    assert len(s.drafts([(1, 100)] * 16, spare=100)[0]) == 2  # 16 running: the batch rule
    assert s.drafts([(1, 100)], spare=1) == [[1]]  # the KV budget's room
    assert s.stats().wasted == 8
