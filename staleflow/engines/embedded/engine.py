"""The embedded CPU rollout engine: continuous batching of a ``transformers`` causal LM.

Every running request keeps its whole sequence but the last token in its cache row; the
last (sampled, not yet cached) token is the input of the next decode step. A step:

1. Preempt: if one more token for every running request would exceed the KV budget
   (``sum(length + 1) > kv_budget_tokens``), move the most recently admitted requests to
   the *front* of the waiting queue (earliest admitted first), dropping their cache rows
   but keeping their partial response, logprobs and versions (recompute preemption, as
   vLLM/SGLang do; they re-prefill ``prompt + response`` on readmission).
2. Admit: take the head of the waiting queue while a slot is free and it fits with one
   token of growth (FIFO, no skipping), and prefill their ``prompt + response`` minus the
   last token, batched with right padding.
3. Decode one token for every running request in one batched forward, then retire the
   finished ones (EOS, included in the response, or ``max_response`` tokens).

So after every step ``kv_tokens = sum(prompt + response)`` over running requests is at
most the budget. Requests whose ``prompt + max_response`` exceeds ``max_seq_len``, or
whose response is already ``max_response`` long, are refused at :meth:`submit` with a
``ValueError`` (nothing is queued from that call).

Logprobs are ``log_softmax(logits / T)[token]``: the sampled token under the policy at
temperature ``T`` *before* top-p renormalisation (``log_softmax(logits)`` when greedy,
``T == 0``); see :mod:`staleflow.engines.embedded.sampling`, which also explains why
sampling is reproducible across batching, preemption and interrupt/resume.

Weight updates (:meth:`EmbeddedEngine.load_weights`) copy into the model in place and keep
the KV cache of running requests (as SGLang's in-place update does): their past K/V came
from older weights, and only tokens sampled after the load carry the new version.

Multi-turn (``prefix_cache_tokens`` > 0, :mod:`~staleflow.engines.embedded.prefix_store`):
a request that finishes at its stop token leaves a copy of its cache row behind, keyed by
trajectory; when the trajectory's next turn (``prompt + turns + observation``) is
admitted, the longest common prefix is copied back and only the rest is prefilled, which
computes what a full prefill would. The copies are dropped at every weight load (so the
next turn is exactly that of the new weights), at an abort, and by :meth:`drop_prefixes`;
:meth:`held_prefixes` lists the trajectories whose prefix is kept, for routing their next
turn here.

A model with LoRA adapters injected (``trainer.lora``, :mod:`staleflow.models.lora`) runs
them unmerged, as the trainer does: a version is then the adapter alone (its
:meth:`~EmbeddedEngine.weight_shapes` are the adapter's), loaded the same way, and the
frozen base arrives once through :meth:`~EmbeddedEngine.load_base_weights`.

The engine owns the model it is given (puts it in eval mode and overwrites its parameters
on ``load_weights``) and is single-threaded: no internal threads, driven by its caller.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from staleflow.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    EngineState,
    GenerationRequest,
    StepTimes,
)
from staleflow.engines.checks import (
    CheckedRequest,
    RequestRecord,
    check_request,
    check_unique,
)
from staleflow.engines.drafts import SpeculationStats, accepted
from staleflow.engines.embedded import sampling
from staleflow.engines.embedded.config import EmbeddedEngineConfig
from staleflow.engines.embedded.prefix_store import HeldPrefix, PrefixStore, common_prefix
from staleflow.engines.embedded.runner import ModelRunner, padded_batches
from staleflow.engines.embedded.speculator import Speculator
from staleflow.engines.embedded.weights import copy_checked
from staleflow.models import lora

logger = logging.getLogger(__name__)

_INT32 = np.iinfo(np.int32)


class _Request(RequestRecord):
    __slots__ = ("admitted",)

    def __init__(self, req: CheckedRequest) -> None:
        super().__init__(req)
        self.admitted = -1  # admission sequence number while running

    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.tokens, dtype=np.int32)])


class EmbeddedEngine:
    """A :class:`~staleflow.engines.base.RolloutEngine` running a ``transformers`` model on
    CPU (any device the model sits on works; CPU is what it is built and tested for)."""

    loads_adapters = True  # a model with LoRA adapters: a version is the adapter

    def __init__(self, model: nn.Module, config: EmbeddedEngineConfig, *, version: int = 0) -> None:
        if not isinstance(config, EmbeddedEngineConfig):
            raise TypeError(f"config must be an EmbeddedEngineConfig, got {type(config).__name__}")
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        model.eval()
        self._runner = ModelRunner(model)
        shape = self._runner.shape
        if shape.max_positions is not None and config.max_seq_len > shape.max_positions:
            # RoPE runs past it (HF does not enforce it either), but the model was not
            # trained there: say so rather than refuse.
            logger.warning(
                "max_seq_len=%d exceeds the model's max_position_embeddings=%d",
                config.max_seq_len,
                shape.max_positions,
            )
        for tok in config.eos_ids:
            if tok >= shape.vocab_size:
                raise ValueError(
                    f"eos_token_id {tok} is outside the model's vocabulary of {shape.vocab_size}"
                )
        self.config = config
        self._model = model
        self._eos = frozenset(config.eos_ids)
        self._version = int(version)
        # Deduplicated (tied weights appear once), the same names a trainer's
        # named_parameters() yields; with adapters, a version's are the adapter's and the
        # base's come once (staleflow.models.lora names both)
        self.adapters = lora.has_adapters(model)
        self._base: dict[str, nn.Parameter] = {}
        self._params: dict[str, nn.Parameter] = dict(model.named_parameters())
        if self.adapters:
            self._base = lora.base_parameters(model)
            self._params = lora.adapter_parameters(model)
        with torch.inference_mode():
            self._cache = self._runner.new_cache(config.max_running, config.max_seq_len)
        self._rows: list[_Request] = []  # running; index == cache row
        self._waiting: deque[_Request] = deque()
        self._known: dict[int, _Request] = {}
        self._admissions = 0
        self._prefill_s = 0.0
        self._decode_s = 0.0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._prefixes = PrefixStore(config.prefix_cache_tokens, config.prefix_cache_trajs)
        self._prefix_hits = 0
        self._prefix_tokens = 0
        self.preemptions = 0
        spec = config.speculation
        self._spec = None if spec is None else Speculator(spec)
        logger.info(
            "embedded engine: %d layers, %d/%d heads, KV cache %.1f MiB (%d slots x %d tokens), "
            "budget %d tokens",
            shape.num_layers,
            shape.num_heads,
            shape.kv_heads,
            self._cache.nbytes() / 2**20,
            config.max_running,
            config.max_seq_len,
            config.kv_budget_tokens,
        )

    # ----------------------------------------------------------------- requests in / out

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        shape = self._runner.shape
        checked = [
            check_request(r, vocab_size=shape.vocab_size, max_seq_len=self.config.max_seq_len)
            for r in requests
        ]
        check_unique(checked, self._known)
        for c in checked:
            r = _Request(c)
            self._waiting.append(r)
            self._known[r.traj_id] = r
            if self._spec is not None:
                self._spec.add(r.traj_id, c.group_id, r.prompt, r.tokens, c.draft_method)

    def interrupt(self, traj_ids: Iterable[int]) -> dict[int, EngineOutput]:
        return {r.traj_id: r.output(None) for r in self._remove(traj_ids)}

    def abort(self, traj_ids: Iterable[int]) -> list[int]:
        """Drop requests for good, and the prefix kept for their next turn."""
        ids = list(traj_ids)
        self._prefixes.drop(ids)
        return [r.traj_id for r in self._remove(ids)]

    def held_prefixes(self) -> tuple[int, ...]:
        """Trajectories whose KV this engine keeps for their next turn, least recently
        kept first: a next turn routed here prefills only its observation."""
        return self._prefixes.held()

    def held_prefix_sizes(self) -> tuple[tuple[int, int], ...]:
        """:meth:`held_prefixes` with the tokens each keeps (what the coordinator's KV
        locality reads: ``InstanceSnapshot.held``)."""
        return self._prefixes.sizes()

    def drop_prefixes(self, traj_ids: Iterable[int]) -> list[int]:
        """Forget the kept prefixes of ``traj_ids`` (their episodes ended); returns those
        that were kept."""
        return self._prefixes.drop(traj_ids)

    def progress(self) -> dict[int, EngineOutput]:
        """``ReportsProgress``: a preempted request keeps its tokens (it is re-prefilled),
        so every token reported here stays in the response."""
        return {tid: r.output(None) for tid, r in self._known.items()}

    def _remove(self, traj_ids: Iterable[int]) -> list[_Request]:
        found = []
        for tid in dict.fromkeys(traj_ids):  # dedupe, keep order
            r = self._known.pop(tid, None)
            if r is None:
                continue
            found.append(r)
            if self._spec is not None:
                self._spec.forget(r.traj_id)
            if r.admitted >= 0:
                self._release_row(self._rows.index(r))
            else:
                self._waiting.remove(r)
        return found

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[EngineOutput]:
        if not self.has_work:
            return []
        self._preempt()
        self._admit()
        return self._decode()

    def _preempt(self) -> None:
        budget = self.config.kv_budget_tokens
        need = sum(r.length + 1 for r in self._rows)
        victims = []
        while need > budget and len(self._rows) > 1:
            row = max(range(len(self._rows)), key=lambda i: self._rows[i].admitted)
            r = self._rows[row]
            need -= r.length + 1
            self._release_row(row)
            victims.append(r)
        # Latest-admitted was taken first; pushing each to the front leaves the earliest
        # admitted at the head, in admission order.
        for r in victims:
            self._waiting.appendleft(r)
        if victims:
            self.preemptions += len(victims)
            logger.debug("preempted %s", [r.traj_id for r in victims])

    def _admit(self) -> None:
        budget, slots = self.config.kv_budget_tokens, self.config.max_running
        used = sum(r.length + 1 for r in self._rows)
        admitted: list[_Request] = []
        while self._waiting and len(self._rows) < slots:
            head = self._waiting[0]
            if used + head.length + 1 > budget:
                break
            self._waiting.popleft()
            used += head.length + 1
            head.admitted = self._admissions
            self._admissions += 1
            self._rows.append(head)
            admitted.append(head)
        if admitted:
            self._prefill(len(self._rows) - len(admitted), admitted)

    def _prefill(self, first_row: int, admitted: list[_Request]) -> None:
        """Cache ``prompt + response[:-1]`` of each admitted request (its last token is the
        next decode input), in right-padded batches of at most ``max_prefill_tokens``; a
        request whose earlier turn left its prefix here gets that copied back and
        prefills only the rest (a batch of its own kind)."""
        t0 = time.perf_counter()
        cap = self.config.max_prefill_tokens
        fresh: list[tuple[int, int, np.ndarray]] = []  # (row, start, tokens to prefill)
        extend: list[tuple[int, int, np.ndarray]] = []
        tokens = 0
        for i, r in enumerate(admitted):
            seq = r.sequence()[:-1]
            row = first_row + i
            start = self._reuse_prefix(r.traj_id, row, seq)
            if start == len(seq):
                continue  # nothing left to cache (a one-token prompt, or all of it kept)
            tokens += len(seq) - start
            (extend if start else fresh).append((row, start, seq[start:]))
        for batch in padded_batches(fresh, cap):
            self._prefill_batch(batch)
        for batch in padded_batches(extend, cap):
            self._prefill_batch(batch, extend=True)
        self._prefill_s += time.perf_counter() - t0
        self._prefill_tokens += tokens

    def _reuse_prefix(self, traj_id: int, row: int, seq: np.ndarray) -> int:
        """Copy the kept K/V of ``traj_id``'s longest common prefix with ``seq`` into
        ``row``; returns its length (0: none kept, or nothing in common)."""
        held = self._prefixes.take(traj_id)
        if held is None:
            return 0
        n = common_prefix(held.tokens, seq)
        if n:
            with torch.inference_mode():
                self._cache.write_row(row, held.k, held.v, n)
            self._prefix_hits += 1
            self._prefix_tokens += n
        return n

    def _prefill_batch(
        self, batch: list[tuple[int, int, np.ndarray]], extend: bool = False
    ) -> None:
        longest = max(len(seq) for _, _, seq in batch)
        ids = np.zeros((len(batch), longest), dtype=np.int64)
        for j, (_, _, seq) in enumerate(batch):
            ids[j, : len(seq)] = seq
        device = self._runner.shape.device
        ids_t = torch.from_numpy(ids).to(device)
        lengths = torch.tensor([len(s) for _, _, s in batch], device=device)
        rows = torch.tensor([row for row, _, _ in batch], device=device)
        if extend:
            starts = torch.tensor([start for _, start, _ in batch], device=device)
            self._runner.extend(self._cache, ids_t, starts, lengths, rows)
        else:
            self._runner.prefill(self._cache, ids_t, lengths, rows)

    def _decode(self) -> list[EngineOutput]:
        rows = self._rows
        if not rows:
            return []
        t0 = time.perf_counter()
        drafts = self._drafts()
        sampled = self._verify(drafts) if any(drafts) else [[p] for p in self._decode_one()]
        finished: list[tuple[int, str]] = []
        version = self._version
        produced = 0
        for i, (r, pairs) in enumerate(zip(rows, sampled, strict=True)):
            start = len(r.tokens)
            reason = None
            for tok, lp in pairs:
                r.tokens.append(tok)
                r.logprobs.append(lp)
                r.versions.append(version)
                if tok in self._eos:
                    reason = FINISH_STOP
                elif len(r.tokens) >= r.max_response:
                    reason = FINISH_LENGTH
                if reason is not None:
                    finished.append((i, reason))
                    break
            produced += len(r.tokens) - start
            if self._spec is not None:
                self._spec.extend(r.traj_id, r.tokens[start:])
        outputs = []
        # Highest rows first, so moving the last row into a hole never moves a finished one.
        for i, reason in reversed(finished):
            r = rows[i]
            if reason == FINISH_STOP and self._prefixes.max_tokens:
                self._keep_prefix(i, r)
            self._release_row(i)
            del self._known[r.traj_id]
            if self._spec is not None:
                self._spec.forget(r.traj_id)  # its tokens stay for its siblings
            outputs.append(r.output(reason))
        outputs.reverse()
        self._decode_tokens += produced
        self._decode_s += time.perf_counter() - t0
        return outputs

    def _keep_prefix(self, row: int, r: _Request) -> None:
        """A turn ended at its stop token: keep its row's K/V (all but that token's, which
        the next turn prefills) for the trajectory's next turn."""
        n = r.length - 1
        if n <= 0 or n > self._prefixes.max_tokens:
            return
        with torch.inference_mode():
            k, v = self._cache.read_row(row, n)
        self._prefixes.put(r.traj_id, HeldPrefix(r.sequence()[:n], k, v))

    def _decode_one(self) -> list[tuple[int, float]]:
        """One token and its logprob for every running request (no drafts)."""
        rows = self._rows
        device = self._runner.shape.device
        last = [r.tokens[-1] if r.tokens else int(r.prompt[-1]) for r in rows]
        ids = torch.tensor(last, dtype=torch.long, device=device)
        positions = torch.tensor([r.length - 1 for r in rows], dtype=torch.long, device=device)
        logits = self._runner.decode(self._cache, ids, positions)
        toks, lps = self._sample(logits, [r.traj_id for r in rows], [len(r.tokens) for r in rows])
        return list(zip(toks, lps, strict=True))

    def _sample(
        self, logits: torch.Tensor, traj_ids: list[int], indices: list[int]
    ) -> tuple[list[int], list[float]]:
        cfg = self.config
        u = sampling.uniforms(cfg.seed, traj_ids, indices)
        with torch.inference_mode():
            toks, lps = sampling.sample(
                logits,
                torch.from_numpy(u).to(logits.device),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
            )
        return toks.tolist(), lps.tolist()

    def _drafts(self) -> list[list[int]]:
        """Each running request's draft (``Speculator.drafts``): one token short of its
        budget (the verified step adds a token of its own), and within the KV budget
        together (a request grows by its accepted drafts plus one)."""
        if self._spec is None:
            return [[] for _ in self._rows]
        spare = self.config.kv_budget_tokens - sum(r.length + 1 for r in self._rows)
        rooms = [(r.traj_id, r.max_response - len(r.tokens) - 1) for r in self._rows]
        return self._spec.drafts(rooms, spare)

    def _verify(self, drafts: list[list[int]]) -> list[list[tuple[int, float]]]:
        """Run every request's last token and draft through one forward and keep, per
        request, the tokens sampled up to and including the first that differs from its
        draft (or the one after a fully accepted draft).

        Token ``i`` is sampled from the target's distribution after ``prompt + response[:i]``
        with the request's own uniform ``u(seed, traj, i)``, exactly as without drafts; a
        draft token ``d`` is accepted iff that sample *is* ``d``. That is the speculative-
        sampling rule for a deterministic draft (accept ``d`` with probability ``p(d)``; on
        rejection draw from ``p`` with ``d`` removed, renormalised), realised with the key
        the plain path uses, so a request samples the tokens it would sample without
        speculation (docs/speculation.md)."""
        rows = self._rows
        device = self._runner.shape.device
        width = 1 + max(len(d) for d in drafts)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        for i, (r, d) in enumerate(zip(rows, drafts, strict=True)):
            ids[i, 0] = r.tokens[-1] if r.tokens else int(r.prompt[-1])
            ids[i, 1 : 1 + len(d)] = d
        lengths = [1 + len(d) for d in drafts]
        logits = self._runner.verify(
            self._cache,
            torch.from_numpy(ids).to(device),
            torch.tensor([r.length - 1 for r in rows], dtype=torch.long, device=device),
            torch.tensor(lengths, dtype=torch.long, device=device),
        )
        keep = [(i, j) for i, n in enumerate(lengths) for j in range(n)]
        flat = logits[[i for i, _ in keep], [j for _, j in keep]]
        toks, lps = self._sample(
            flat, [rows[i].traj_id for i, _ in keep], [len(rows[i].tokens) + j for i, j in keep]
        )
        out = accepted(drafts, toks, lps)
        if self._spec is not None:
            self._spec.record([r.traj_id for r in rows], drafts, out)
        return out

    def _release_row(self, row: int) -> None:
        """Free cache row ``row``, keeping rows dense by moving the last request into it."""
        rows = self._rows
        r = rows[row]
        r.admitted = -1
        tail = rows.pop()
        if tail is not r:
            rows[row] = tail
            with torch.inference_mode():
                self._cache.move(len(rows), row, tail.length - 1)

    # ----------------------------------------------------------------------------- weights

    def weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {
            name: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in self._params.items()
        }

    def load_weights(self, weights: Mapping[str, object], version: int) -> None:
        """Copy every parameter of :meth:`weight_shapes` in place (floating arrays or tensors
        of any float dtype, cast to the parameter's). Unknown, missing, misshapen or
        non-float entries raise ``ValueError`` naming the parameter before anything is
        copied. Running requests keep their KV cache, computed by the older weights."""
        copy_checked(self._params, weights)
        self._version = int(version)
        # kept prefixes were computed by the old weights: a next turn re-prefills
        self._prefixes.clear()
        logger.info(
            "loaded %s of version %d", "the adapter" if self.adapters else "weights", version
        )

    def base_weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """With adapters, the frozen base's parameters (the names of the model without
        adapters); empty otherwise."""
        return {
            name: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in self._base.items()
        }

    def load_base_weights(self, weights: Mapping[str, object]) -> None:
        """Copy the frozen base under the adapters (once, before the first version), checked
        as :meth:`load_weights` checks; the version stays."""
        if not self.adapters:
            raise ValueError(
                "load_base_weights: this engine's model has no LoRA adapters; load_weights "
                "takes all of its weights"
            )
        copy_checked(self._base, weights)
        self._prefixes.clear()
        logger.info("loaded the base weights (%d tensors)", len(self._base))

    # ------------------------------------------------------------------------ observation

    def state(self) -> EngineState:
        return EngineState(
            kv_tokens=sum(r.length for r in self._rows),
            running=tuple((r.traj_id, r.length) for r in self._rows_by_admission()),
            waiting=tuple((r.traj_id, r.length) for r in self._waiting),
            version=self._version,
            preemptions=self.preemptions,
            kv_usage=sum(r.length for r in self._rows) / self.config.kv_budget_tokens,
        )

    def close(self) -> None:
        """Nothing to release: the model and cache are plain tensors of this process."""

    def _rows_by_admission(self) -> list[_Request]:
        return sorted(self._rows, key=lambda r: r.admitted)

    def speculation_stats(self) -> SpeculationStats | None:
        """Counters of verified drafts since the engine started (None: speculation off)."""
        return None if self._spec is None else self._spec.stats()

    def speculation_stats_by_method(self) -> dict[str, SpeculationStats] | None:
        """The counters per draft method (a request's own, ``draft_method``, or the
        engine's); None: speculation off."""
        return None if self._spec is None else self._spec.stats_by_method()

    @property
    def drafts_from_siblings(self) -> bool:
        """Grouped drafts (the engine's method, or a request's): siblings on other
        instances help (``add_group_responses``)."""
        return self._spec is not None and self._spec.grouped

    def add_group_responses(
        self,
        group_id: int,
        prompt: np.ndarray,
        responses: Iterable[np.ndarray],
        traj_ids: Sequence[int] | None = None,
        starts: Sequence[int] | None = None,
    ) -> None:
        """Responses of ``group_id`` generated elsewhere (siblings on other instances),
        for its members here to draft from (no-op without grouped speculation). With
        ``traj_ids``, response ``i`` is sibling ``traj_ids[i]``'s from index ``starts[i]``
        (0 if not given) on, and goes on what was handed over of it before."""
        if self._spec is not None:
            for i, tokens in enumerate(responses):
                tid = None if traj_ids is None else traj_ids[i]
                start = 0 if starts is None else starts[i]
                self._spec.add_reference(group_id, prompt, tokens, tid, start)

    def forget_groups(self, group_ids: Iterable[int]) -> None:
        """Drop the drafts of groups that were consumed or aborted (no-op without
        speculation; groups beyond the draft source's bound go on their own)."""
        if self._spec is not None:
            for g in group_ids:
                self._spec.forget_group(g)

    def times(self) -> StepTimes:
        return StepTimes(
            prefill_s=self._prefill_s,
            decode_s=self._decode_s,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
            prefix_hits=self._prefix_hits,
            prefix_tokens=self._prefix_tokens,
        )

    @property
    def has_work(self) -> bool:
        return bool(self._rows or self._waiting)

    @property
    def version(self) -> int:
        return self._version
