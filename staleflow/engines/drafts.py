"""Model-free draft tokens from a trajectory's group (Seer §3.3/§4.4), for speculative decoding.

The responses of one GRPO group answer the same prompt and share much of their wording, so
the tokens that followed the current context in a sibling's response (or earlier in the
trajectory's own) are good guesses for what comes next. A draft never goes stale as the
policy trains: it is built from what the current policy's siblings just sampled.

:class:`GroupedDraftSource` keeps, per group, every sequence it was shown (the prompt once,
and each member's response as it grows) and an n-gram index over them: n-gram -> the places
it occurred, i.e. the index of the token that followed it. To draft for a trajectory it
takes the longest suffix of the trajectory's own ``prompt + response`` (``min_ngram`` to
``max_ngram`` tokens) that occurred before in the group, then walks forward from all its
occurrences at once, each step taking the continuation most of the still-agreeing
occurrences share (a majority path through the group's suffix trie, as a count-weighted
suffix tree gives). That is one path of up to ``k`` tokens; it stops where no occurrence
goes on. Cost: ``max_ngram`` dict updates per token, paid lazily (appending only stores the
token; a group is indexed up to date when one of its members drafts, so a full batch that
the adaptive range gives no draft pays nothing per step), and ``O(max_ngram + k * m)`` per
draft with ``m <= max_matches`` occurrences kept per n-gram (the most recent ones).

``scope="own"`` indexes each trajectory alone (prompt + own response): the classic
prompt-lookup / own-history n-gram draft, the baseline grouped drafts are compared with.

Groups are forgotten when told (:meth:`forget_group`: the group was consumed or aborted) and,
as a bound on memory, the least recently touched group goes once more than ``max_groups``
are held. Pure Python and numpy: it can live in an engine, an instance or a service.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

SCOPES = ("group", "own")
# a request's draft method (``GenerationRequest.draft_method``): a scope, or no drafts
METHODS = (*SCOPES, "off")


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """How drafts are found. ``min_ngram``..``max_ngram``: the context suffix lengths tried,
    longest first; ``max_matches``: occurrences kept per n-gram (the latest);
    ``max_groups``: groups held before the least recently used is forgotten."""

    scope: str = "group"
    min_ngram: int = 2
    max_ngram: int = 6
    max_matches: int = 32
    max_groups: int = 4096

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"draft scope must be one of {SCOPES}, got {self.scope!r}")
        for name in ("min_ngram", "max_ngram", "max_matches", "max_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"draft {name} must be a positive int, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"draft min_ngram={self.min_ngram} exceeds max_ngram={self.max_ngram}; "
                "lower min_ngram or raise max_ngram"
            )


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    """Speculative decoding from drafts (an engine's ``speculation`` setting; None: off).

    Adaptive draft length (Seer §4.4's adaptive range): a verification step feeds every
    running request its draft, so its cost grows with ``running x draft``; a request drafts
    at most ``max_draft`` tokens and the batch at most ``batch_draft_tokens`` together, so a
    full batch early in a rollout drafts little (verification would cost most there) and the
    few long requests of the tail draft long (where a forward costs the same for 1 token or
    ``max_draft``)."""

    drafts: DraftSettings = DraftSettings()
    max_draft: int = 8
    batch_draft_tokens: int = 32
    # a per-request draft window that follows the request's own acceptance (SpecActor
    # §4.1's feedback window; staleflow.engines.embedded.draft_window): off by default
    window: bool = False
    min_window: int = 1

    def __post_init__(self) -> None:
        for name in ("max_draft", "batch_draft_tokens", "min_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculation {name} must be a positive int, got {value!r}")
        if not isinstance(self.window, bool):
            raise ValueError(f"speculation window must be a bool, got {self.window!r}")
        if self.min_window > self.max_draft:
            raise ValueError(
                f"speculation min_window={self.min_window} exceeds max_draft={self.max_draft}; "
                "lower min_window"
            )

    def draft_length(self, running: int) -> int:
        """The most draft tokens a request may verify when ``running`` requests decode."""
        return min(self.max_draft, self.batch_draft_tokens // max(running, 1))


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    """Counters of an engine's speculation since it started: ``verifications`` (a request's
    draft verified in a step), ``drafted`` draft tokens, ``accepted`` of them."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def wasted(self) -> int:
        """Draft tokens verified and rejected (computed for nothing)."""
        return self.drafted - self.accepted

    @property
    def accepted_per_verification(self) -> float:
        return self.accepted / self.verifications if self.verifications else 0.0

    def __add__(self, other: SpeculationStats) -> SpeculationStats:
        """Counts of two engines (or two lifetimes of one) together."""
        return SpeculationStats(
            self.verifications + other.verifications,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
        )

    def __sub__(self, other: SpeculationStats) -> SpeculationStats:
        return SpeculationStats(
            self.verifications - other.verifications,
            self.drafted - other.drafted,
            self.accepted - other.accepted,
        )


class _Group:
    """The sequences of one group and the n-gram index over them."""

    __slots__ = ("by_traj", "index", "indexed", "prompt_seq", "seqs")

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []
        # trajectory -> its response's sequence (a member's, or a sibling's from elsewhere),
        # so that a sibling handed over in pieces, or a member coming back, goes on in one
        self.by_traj: dict[int, int] = {}
        # n-gram -> [(sequence, index of the token that followed it)], oldest first
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.prompt_seq = -1
        # tokens of each sequence in the index: appending only stores tokens, and a group is
        # indexed up to date when one of its members drafts, so a full batch that drafts
        # nothing (the adaptive range gives it no draft tokens) pays no indexing per step
        self.indexed: list[int] = []


class _Member:
    __slots__ = ("group", "key", "resp_seq")

    def __init__(self, key: int, group: _Group, resp_seq: int) -> None:
        self.key = key
        self.group = group
        self.resp_seq = resp_seq


class GroupedDraftSource:
    """Per-group n-gram index over the members' responses; see the module docstring."""

    def __init__(self, settings: DraftSettings | None = None) -> None:
        self.settings = settings or DraftSettings()
        self._groups: OrderedDict[int, _Group] = OrderedDict()
        self._members: dict[int, _Member] = {}

    # ------------------------------------------------------------------------- feeding

    def add(
        self,
        traj_id: int,
        group_id: int | None,
        prompt: Sequence[int],
        tokens: Sequence[int],
        scope: str | None = None,
    ) -> None:
        """Start following ``traj_id`` (a member of ``group_id``; None: a group of its own)
        whose response so far is ``tokens``. A trajectory the group holds already (resumed
        after an interrupt, or a sibling handed over from elsewhere before it came here)
        goes on from the tokens held when they are a prefix of ``tokens``, else starts a new
        response; the old tokens stay as a reference of the group either way.

        ``scope`` overrides the settings' for this trajectory (a request's own draft
        method, e.g. a race copy drafting otherwise than its original)."""
        s = self.settings
        scope = s.scope if scope is None else scope
        if scope not in SCOPES:
            raise ValueError(f"trajectory {traj_id}: draft scope must be one of {SCOPES}")
        if group_id is not None and group_id < 0:
            raise ValueError(f"trajectory {traj_id}: group_id {group_id} is negative")
        # A trajectory drafting from itself alone is a group of its own, keyed below 0 so
        # that the two id spaces never meet.
        key = -1 - traj_id if group_id is None or scope == "own" else group_id
        prompt_list = [int(t) for t in np.asarray(prompt).tolist()]
        token_list = [int(t) for t in np.asarray(tokens).tolist()]
        group = self._group(key)
        if group.prompt_seq < 0:
            group.prompt_seq = self._new_seq(group, prompt_list)
        resp = group.by_traj.get(traj_id, -1)
        seq = group.seqs[resp] if resp >= 0 else []
        if resp < 0 or len(seq) > len(token_list) or seq != token_list[: len(seq)]:
            resp = group.by_traj[traj_id] = self._new_seq(group, [])
        self._members[traj_id] = _Member(key, group, resp)
        self.extend(traj_id, token_list[len(group.seqs[resp]) :])

    def extend(self, traj_id: int, tokens: Sequence[int]) -> None:
        """Append newly sampled ``tokens`` to ``traj_id``'s response (unknown ids: no-op)."""
        m = self._members.get(traj_id)
        if m is not None and len(tokens):
            self._append(m.group, m.resp_seq, tokens)

    def add_reference(
        self,
        group_id: int,
        prompt: Sequence[int],
        tokens: Sequence[int],
        traj_id: int | None = None,
        start: int = 0,
    ) -> None:
        """Add a response of ``group_id`` generated elsewhere (a sibling that ran on another
        instance, reported by the TS): it drafts for the group's members here.

        With ``traj_id``, ``tokens`` are that sibling's response from index ``start`` on:
        they go on the sequence held for it (one sequence per sibling, however many pieces
        it arrives in; a member that ran here before is continued, not copied). A piece that
        does not fit what is held (a gap before ``start``, or other tokens) starts the
        sibling afresh if ``start`` is 0 and is dropped otherwise. A trajectory this source
        follows now is never written from elsewhere.

        In ``own`` scope only a group that one of its members drafts from in ``group`` scope
        (a request's own method) takes references; others are ignored."""
        if group_id < 0:
            raise ValueError(f"group_id {group_id} is negative")
        if self.settings.scope == "own" and group_id not in self._groups:
            return
        if traj_id is not None and traj_id in self._members:
            return
        g = self._group(group_id)
        if g.prompt_seq < 0:
            g.prompt_seq = self._new_seq(g, [int(t) for t in np.asarray(prompt).tolist()])
        new = [int(t) for t in np.asarray(tokens).tolist()]
        held = g.by_traj.get(traj_id, -1) if traj_id is not None else -1
        if held >= 0:
            seq = g.seqs[held]
            overlap = len(seq) - start  # tokens of the piece held already
            if overlap >= 0 and seq[start : start + len(new)] == new[:overlap]:
                self._append(g, held, new[overlap:])
                return
        if start != 0:
            return
        seq_id = self._new_seq(g, [])
        if traj_id is not None:
            g.by_traj[traj_id] = seq_id
        self._append(g, seq_id, new)

    def _append(self, g: _Group, seq_id: int, tokens: Sequence[int]) -> None:
        g.seqs[seq_id].extend(int(t) for t in tokens)

    def _catch_up(self, g: _Group) -> None:
        """Index the tokens appended to ``g`` since it was last indexed."""
        prompt = g.seqs[g.prompt_seq]
        n_max, cap = self.settings.max_ngram, self.settings.max_matches
        index = g.index
        for seq_id, seq in enumerate(g.seqs):
            start = g.indexed[seq_id]
            if start == len(seq):
                continue
            # the n-grams that straddle the prompt/response boundary: a response's history
            # is prompt + response (the prompt itself is a sequence with none before it)
            lead = [] if seq_id == g.prompt_seq else prompt[max(0, len(prompt) - n_max) :]
            full = lead + seq
            off = len(lead)
            for end in range(start + 1, len(seq) + 1):
                at = end + off  # the n-grams ending at token end-1 are followed by index end
                for n in range(1, min(n_max, at) + 1):
                    occ = index.setdefault(tuple(full[at - n : at]), [])
                    occ.append((seq_id, end))
                    if len(occ) > cap:
                        del occ[0]
            g.indexed[seq_id] = len(seq)

    def forget(self, traj_id: int) -> None:
        """Stop following ``traj_id``; its tokens stay as a reference for its group (a group
        of its own goes with it)."""
        m = self._members.pop(traj_id, None)
        if m is not None and m.key < 0:
            self._groups.pop(m.key, None)

    def forget_group(self, group_id: int) -> None:
        """Drop a group (consumed or aborted) and its members."""
        g = self._groups.pop(group_id, None)
        if g is not None:
            self._drop_members(g)

    def _group(self, key: int) -> _Group:
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group()
            while len(self._groups) > self.settings.max_groups:
                _, old = self._groups.popitem(last=False)
                self._drop_members(old)
        else:
            self._groups.move_to_end(key)
        return g

    def _drop_members(self, g: _Group) -> None:
        for tid in [t for t, m in self._members.items() if m.group is g]:
            del self._members[tid]

    def _new_seq(self, g: _Group, tokens: list[int]) -> int:
        g.seqs.append(tokens)
        g.indexed.append(0)
        return len(g.seqs) - 1

    # ------------------------------------------------------------------------- drafting

    def draft(self, traj_id: int, k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``traj_id``'s ``prompt + response``; [] when
        its context occurred nowhere before in its group (or ``traj_id`` is unknown)."""
        m = self._members.get(traj_id)
        if m is None or k < 1:
            return []
        g = m.group
        self._catch_up(g)
        s = self.settings
        seq = g.seqs[m.resp_seq]
        context = seq[-s.max_ngram :]
        if len(context) < s.max_ngram:
            prompt = g.seqs[g.prompt_seq]
            context = prompt[len(prompt) - (s.max_ngram - len(context)) :] + context
        here = (m.resp_seq, len(seq))
        for n in range(min(s.max_ngram, len(context)), s.min_ngram - 1, -1):
            occ = [o for o in g.index.get(tuple(context[-n:]), ()) if o != here]
            if occ:
                out = self._walk(g, occ, k)
                if out:
                    return out
        return []

    @staticmethod
    def _walk(g: _Group, occ: list[tuple[int, int]], k: int) -> list[int]:
        """Follow the occurrences forward, each step the continuation most of them share
        (ties: the most recent occurrence's), dropping those that disagree."""
        out: list[int] = []
        live = occ
        for step in range(k):
            votes: Counter[int] = Counter()
            latest: dict[int, int] = {}
            for i, (sq, pos) in enumerate(live):
                seq = g.seqs[sq]
                if pos + step < len(seq):
                    tok = seq[pos + step]
                    votes[tok] += 1
                    latest[tok] = i
            if not votes:
                break
            best = max(votes, key=lambda t: (votes[t], latest[t]))
            out.append(best)
            live = [
                o
                for o in live
                if o[1] + step < len(g.seqs[o[0]]) and g.seqs[o[0]][o[1] + step] == best
            ]
        return out

    # ------------------------------------------------------------------------ observing

    @property
    def groups(self) -> int:
        return len(self._groups)

    @property
    def grouped(self) -> bool:
        """Some trajectory here drafts from its group (siblings elsewhere would help)."""
        return self.settings.scope == "group" or any(m.key >= 0 for m in self._members.values())

    def __contains__(self, traj_id: int) -> bool:
        return traj_id in self._members


def accepted(
    drafts: list[list[int]], tokens: list[int], logprobs: list[float]
) -> list[list[tuple[int, float]]]:
    """Per request, the (token, logprob) pairs a verification keeps: ``tokens`` holds, for
    each request in turn, the ``1 + len(draft)`` tokens sampled after its last token and
    each draft token; a request keeps them up to and including the first that differs from
    its draft, or all of them after a draft accepted whole."""
    out: list[list[tuple[int, float]]] = []
    at = 0
    for d in drafts:
        pairs = []
        for j in range(1 + len(d)):
            pairs.append((tokens[at + j], logprobs[at + j]))
            if j == len(d) or tokens[at + j] != d[j]:
                break
        at += 1 + len(d)
        out.append(pairs)
    return out
