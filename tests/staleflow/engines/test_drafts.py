"""The grouped draft source: drafts come from the group's responses and the trajectory's
own history, follow the majority continuation, and groups are forgotten when told."""

from __future__ import annotations

import pytest

from staleflow.engines.drafts import DraftSettings, GroupedDraftSource

PROMPT = [1, 2, 3]


def test_a_sibling_response_drafts_what_followed_the_same_context() -> None:
    src = GroupedDraftSource(DraftSettings(min_ngram=2, max_ngram=4))
    src.add(10, 7, PROMPT, [20, 21, 22, 23, 24, 25])
    src.add(11, 7, PROMPT, [30, 21, 22])
    assert src.draft(11, 3) == [23, 24, 25]
    assert src.draft(11, 10) == [23, 24, 25]  # the sibling ends there
    src.extend(11, [23, 24])
    assert src.draft(11, 2) == [25]


def test_own_scope_ignores_siblings_but_uses_own_history() -> None:
    src = GroupedDraftSource(DraftSettings(scope="own", min_ngram=2, max_ngram=4))
    src.add(10, 7, PROMPT, [20, 21, 22, 23, 24, 25])
    src.add(11, 7, PROMPT, [30, 21, 22])
    assert src.draft(11, 3) == []
    src.extend(11, [40, 41, 21, 22])  # 21 22 occurred earlier in its own response
    assert src.draft(11, 3) == [40, 41, 21]


def test_the_prompt_is_history_too() -> None:
    src = GroupedDraftSource(DraftSettings(min_ngram=2, max_ngram=3))
    src.add(5, 1, [9, 8, 7, 6, 5], [9, 8])
    assert src.draft(5, 2) == [7, 6]


def test_the_majority_continuation_wins_and_disagreeing_occurrences_drop() -> None:
    src = GroupedDraftSource(DraftSettings(min_ngram=2, max_ngram=2))
    src.add(1, 0, PROMPT, [50, 51, 60, 61])
    src.add(2, 0, PROMPT, [50, 51, 70, 71])
    src.add(3, 0, PROMPT, [50, 51, 70, 72])
    src.add(4, 0, PROMPT, [50, 51])
    # two of three siblings go on with 70, and of those the latest goes on with 72
    assert src.draft(4, 3) == [70, 72]


def test_the_longest_matching_suffix_is_used() -> None:
    src = GroupedDraftSource(DraftSettings(min_ngram=1, max_ngram=3))
    src.add(1, 0, PROMPT, [5, 6, 7, 100])  # 6 7 -> 100 (and 5 6 7 -> 100)
    src.add(2, 0, PROMPT, [9, 7, 200, 7, 200])  # 7 -> 200 twice
    src.add(3, 0, PROMPT, [5, 6, 7])
    assert src.draft(3, 1) == [100]


def test_resume_extends_and_a_changed_response_starts_afresh() -> None:
    src = GroupedDraftSource(DraftSettings(min_ngram=2, max_ngram=2))
    src.add(1, 0, PROMPT, [10, 11, 12])
    src.add(1, 0, PROMPT, [10, 11, 12, 13])  # resumed with one more token
    src.add(2, 0, PROMPT, [12])
    assert src.draft(2, 1) == []  # only the prompt's 3 then 12 is its context
    src.extend(2, [13])
    assert src.draft(2, 5) == []  # 12 13 ended trajectory 1's response
    src.add(1, 0, PROMPT, [10, 99])  # not a prefix: a new response; the old one stays
    src.add(3, 0, PROMPT, [10, 11])
    assert src.draft(3, 2) == [12, 13]


def test_groups_are_forgotten_when_consumed_and_beyond_the_bound() -> None:
    src = GroupedDraftSource(DraftSettings(min_ngram=2, max_ngram=2, max_groups=2))
    src.add(1, 0, PROMPT, [10, 11, 12])
    src.add(2, 0, PROMPT, [10, 11])
    assert src.draft(2, 1) == [12]
    src.forget_group(0)
    assert 1 not in src and 2 not in src and src.groups == 0
    assert src.draft(2, 1) == []
    for g in range(3):
        src.add(100 + g, g, PROMPT, [1])
    assert src.groups == 2 and 100 not in src and 102 in src
    src.forget(102)  # a finished member's tokens stay for its siblings
    assert src.groups == 2


def test_own_scope_forgets_with_the_trajectory() -> None:
    src = GroupedDraftSource(DraftSettings(scope="own"))
    src.add(1, 0, PROMPT, [10])
    src.forget(1)
    assert src.groups == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scope": "all"}, "scope"),
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 5, "max_ngram": 3}, "exceeds"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DraftSettings(**kwargs)


def test_references_from_elsewhere_draft_for_the_group_but_not_in_own_scope() -> None:
    for scope, want in (("group", [12, 13]), ("own", [])):
        src = GroupedDraftSource(DraftSettings(scope=scope, min_ngram=2, max_ngram=2))
        src.add_reference(4, PROMPT, [10, 11, 12, 13])
        src.add(1, 4, PROMPT, [10, 11])
        assert src.draft(1, 2) == want


def test_a_sibling_handed_over_in_pieces_is_one_sequence() -> None:
    """The TS hands a sibling's response over as it grows (index ``start`` on): the pieces
    join into one sequence, so a draft runs across the joint; a piece that does not fit
    starts afresh only from 0, and a trajectory followed here is never written from
    elsewhere."""
    src = GroupedDraftSource(DraftSettings(min_ngram=2, max_ngram=2))
    src.add_reference(4, PROMPT, [10, 11, 12], traj_id=7)
    src.add_reference(4, PROMPT, [12, 13, 14], traj_id=7, start=2)  # overlaps by one
    src.add(1, 4, PROMPT, [10, 11])
    assert src.draft(1, 4) == [12, 13, 14]
    src.add_reference(4, PROMPT, [99], traj_id=7, start=9)  # a gap: dropped
    src.add_reference(4, PROMPT, [50, 51], traj_id=7, start=1)  # other tokens: dropped
    assert src.draft(1, 4) == [12, 13, 14]
    src.add_reference(4, PROMPT, [10, 11, 12, 13, 14, 15], traj_id=1)  # followed here
    assert src.draft(1, 5) == [12, 13, 14]
    # a member that ran here and left goes on from the TS's copy of it (its sequence is the
    # latest of the two to go on from 10 11) and, resumed here later, from there again
    src.forget(1)
    src.add_reference(4, PROMPT, [10, 11, 20, 21], traj_id=1)
    src.add(2, 4, PROMPT, [10, 11])
    assert src.draft(2, 3) == [20, 21]
    src.add(1, 4, PROMPT, [10, 11, 20, 21, 22])
    src.add(3, 4, PROMPT, [20, 21])
    assert src.draft(3, 1) == [22]


def test_a_trajectory_may_draft_in_another_scope_than_the_sources() -> None:
    """A request's own draft method (a race copy's): in a group-scoped source an ``own``
    member drafts from its own history only; in an own-scoped source a ``group`` member
    drafts from its group, and that group then takes references from elsewhere."""
    src = GroupedDraftSource(DraftSettings(scope="group", min_ngram=2, max_ngram=2))
    src.add(1, 4, PROMPT, [10, 11, 12, 13])
    src.add(2, 4, PROMPT, [10, 11], scope="own")
    src.add(3, 4, PROMPT, [10, 11])
    assert src.draft(2, 2) == [] and src.draft(3, 2) == [12, 13]
    assert src.grouped
    own = GroupedDraftSource(DraftSettings(scope="own", min_ngram=2, max_ngram=2))
    own.add(1, 4, PROMPT, [10, 11])
    assert not own.grouped
    own.add_reference(4, PROMPT, [10, 11, 12, 13])  # no member drafts from group 4: ignored
    own.add(2, 4, PROMPT, [10, 11], scope="group")
    assert own.grouped and own.draft(2, 2) == []
    own.add_reference(4, PROMPT, [10, 11, 12, 13])
    assert own.draft(2, 2) == [12, 13] and own.draft(1, 2) == []
    with pytest.raises(ValueError, match="scope"):
        own.add(3, 4, PROMPT, [], scope="eagle")
