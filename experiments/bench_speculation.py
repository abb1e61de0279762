"""Speculative decoding in the embedded engine: grouped drafts vs own-history drafts vs none.

The task is the long tail of a GRPO rollout: each running trajectory is the last member of
its group, its ``--group - 1`` siblings finished already (their responses are handed to the
engine as the group's references, as the TS would hand over siblings from other
instances). At each batch size (``--batches``, running trajectories, one per group) the
same stragglers decode ``--tokens`` tokens under each side, side by side in one run:

* ``none``: one token per request per step;
* ``own``: drafts from the trajectory's own prompt and response (prompt-lookup n-gram);
* ``group``: drafts from the group's responses and its own history (Seer's grouped drafts);
* ``group-k8``: grouped drafts of a fixed 8 tokens whatever the batch size, to show what
  the adaptive range (``max_draft`` 8, ``batch_draft_tokens`` 32) saves at large batches;
* ``own-window`` / ``group-window``: ``own`` / ``group`` with the per-request draft window
  (``SpeculationSettings.window``, ``staleflow.engines.embedded.draft_window``).

``--sides`` picks some (``none`` always runs: the others are checked against it).

``--race-methods`` measures instead what racing a straggler under another draft method
would give (the tail race's fastest-of-N over draft methods, SpecActor §4.2): each
straggler alone (batch 1, as a copy on an idle instance runs) under ``group``, ``own``
and ``off`` (``GenerationRequest.draft_method``, one engine configured ``group``), the
decode steps each needs to finish; a step at batch 1 costs about the same whatever the
draft, so the fewer steps finish first on an instance as fast. Reported: mean steps per
method, how often each method is the fastest, and the mean of the faster of ``group``
and ``own`` (a race of the two on equally fast instances) against ``group`` alone.

Group-correlated responses need a model whose siblings agree, as a trained policy's do: a
randomly initialised Qwen2 (nothing downloaded) has its final norm scaled by
``--sharpness``, which makes its next-token distributions peaked (the mean entropy of the
sampled tokens is printed). The sampled tokens of every side are checked to be the same
(keyed sampling: speculation changes how fast, not what; up to float rounding, see
docs/speculation.md). Figures: decode tokens/s (the engine's own decode wall time, prefill
excluded), tokens per CPU second of the process (prefill included, which is small here;
on a machine shared with busy processes, wall-clock figures swing several-fold within
seconds while CPU time of the single-threaded process does not), both the median over
``--repeats``; mean accepted draft tokens per verification, drafts wasted, and the
share of the decode time spent finding drafts (``draft_share``). One torch thread by
default.

    OMP_NUM_THREADS=1 python experiments/bench_speculation.py --json results/bench_speculation.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from staleflow.engines.base import GenerationRequest
from staleflow.engines.drafts import DraftSettings, SpeculationSettings, SpeculationStats
from staleflow.engines.embedded import EmbeddedEngine, EmbeddedEngineConfig

SIDES = ("none", "own", "group", "group-k8", "own-window", "group-window")
DEFAULT_SIDES = "none,own,group,group-k8"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    p.add_argument("--sharpness", type=float, default=8.0, help="final-norm scale (default 8)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    p.add_argument("--tokens", type=int, default=256, help="response tokens (default 256)")
    p.add_argument("--group", type=int, default=8, help="group size (default 8)")
    p.add_argument(
        "--batches", default="1,4,16,64", help="running trajectories (default 1,4,16,64)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--max-draft", type=int, default=8, help="draft tokens per request")
    p.add_argument("--batch-draft-tokens", type=int, default=32, help="draft tokens per batch")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, prompts, sampling")
    p.add_argument(
        "--sides", default=DEFAULT_SIDES, help=f"of {','.join(SIDES)} (default {DEFAULT_SIDES})"
    )
    p.add_argument(
        "--race-methods",
        action="store_true",
        help="race each straggler's draft methods at batch 1 instead (module docstring)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    cfg = transformers.Qwen2Config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=args.hidden * 11 // 4,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len + args.tokens + 8,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(args.sharpness)
    return model


def make_engine(
    model: torch.nn.Module, args: argparse.Namespace, side: str, running: int
) -> EmbeddedEngine:
    spec = None
    if side != "none":
        spec = SpeculationSettings(
            drafts=DraftSettings(scope="own" if side.startswith("own") else "group"),
            max_draft=args.max_draft,
            # a fixed draft length: a batch budget no batch size cuts
            batch_draft_tokens=args.max_draft * running
            if side == "group-k8"
            else args.batch_draft_tokens,
            window=side.endswith("-window"),
        )
    seq = args.prompt_len + args.tokens
    return EmbeddedEngine(
        model,
        EmbeddedEngineConfig(
            kv_budget_tokens=max(running, 64) * seq + 64,
            max_running=max(running, 64),
            max_seq_len=seq,
            temperature=args.temperature,
            seed=args.seed,
            speculation=spec,
        ),
    )


def request(
    traj_id: int, prompt: np.ndarray, tokens: int, group: int, method: str | None = None
) -> GenerationRequest:
    e_i, e_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
    return GenerationRequest(traj_id, prompt, e_i, e_f, e_i, tokens, group, method)


def drain(engine: EmbeddedEngine) -> dict[int, Any]:
    done = {}
    while engine.has_work:
        for out in engine.step():
            done[out.traj_id] = out
    return done


def siblings(
    model: torch.nn.Module, args: argparse.Namespace, prompts: list[np.ndarray]
) -> tuple[dict[int, list[np.ndarray]], float]:
    """The finished siblings of every group (untimed), and the mean entropy proxy: the mean
    negative logprob of the sampled tokens."""
    engine = make_engine(model, args, "none", 64)
    members = args.group - 1
    engine.submit(
        [
            request(g * args.group + m, prompts[g], args.tokens, g)
            for g in range(len(prompts))
            for m in range(members)
        ]
    )
    done = drain(engine)
    out = {
        g: [done[g * args.group + m].tokens for m in range(members)] for g in range(len(prompts))
    }
    nll = -float(np.mean(np.concatenate([o.logprobs for o in done.values()])))
    return out, nll


def run_side(
    model: torch.nn.Module,
    args: argparse.Namespace,
    side: str,
    prompts: list[np.ndarray],
    refs: dict[int, list[np.ndarray]],
) -> dict[str, Any]:
    running = len(prompts)
    engine = make_engine(model, args, side, running)
    for g, prompt in enumerate(prompts):
        engine.add_group_responses(g, prompt, refs[g])
    engine.submit(
        [request(g * args.group + args.group - 1, p, args.tokens, g) for g, p in enumerate(prompts)]
    )
    draft_s = [0.0]
    spec = engine._spec  # timing the drafting (part of the decode step) from outside
    if spec is not None:
        drafts = spec.drafts

        def timed(*a: Any, **k: Any) -> list[list[int]]:
            t = time.perf_counter()
            out = drafts(*a, **k)
            draft_s[0] += time.perf_counter() - t
            return out

        spec.drafts = timed  # type: ignore[method-assign]
    t0, c0 = time.perf_counter(), time.process_time()
    done = drain(engine)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t = engine.times()
    stats = engine.speculation_stats() or SpeculationStats()  # None: speculation off
    return {
        "decode_tokens_per_s": t.decode_tokens / t.decode_s,
        "cpu_tokens_per_s": t.decode_tokens / cpu,
        "wall_s": wall,
        "draft_share": draft_s[0] / t.decode_s,
        "accepted_per_verification": stats.accepted_per_verification,
        "verifications": stats.verifications,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "wasted": stats.wasted,
        "tokens": {tid: o.tokens.tolist() for tid, o in done.items()},
    }


RACED = ("group", "own", "off")


def race_methods(
    model: torch.nn.Module,
    args: argparse.Namespace,
    prompts: list[np.ndarray],
    refs: dict[int, list[np.ndarray]],
) -> dict[str, Any]:
    """Each straggler alone under each draft method: decode steps to finish (see the
    module docstring); the tokens must be the same under every method."""
    steps: dict[str, list[int]] = {m: [] for m in RACED}
    for g, prompt in enumerate(prompts):
        tokens = None
        for method in RACED:
            engine = make_engine(model, args, "group", 1)
            engine.add_group_responses(g, prompt, refs[g])
            tid = g * args.group + args.group - 1
            engine.submit([request(tid, prompt, args.tokens, g, method)])
            n, out = 0, []
            while engine.has_work:
                out += engine.step()
                n += 1
            steps[method].append(n - 1)  # the first step is the prefill's token
            if tokens is None:
                tokens = out[0].tokens.tolist()
            elif out[0].tokens.tolist() != tokens:
                raise AssertionError(f"group {g}: {method} sampled other tokens")
    n = len(prompts)
    mean = {m: statistics.fmean(v) for m, v in steps.items()}
    fastest = {m: 0.0 for m in RACED}
    for i in range(n):
        best = min(steps[m][i] for m in RACED)
        winners = [m for m in RACED if steps[m][i] == best]
        for m in winners:  # a tie counts for each, split
            fastest[m] += 1 / len(winners)
    race = statistics.fmean(min(a, b) for a, b in zip(steps["group"], steps["own"], strict=True))
    result = {
        "stragglers": n,
        "mean_steps": mean,
        "fastest_share": {m: f / n for m, f in fastest.items()},
        "own_beats_group": sum(o < g for o, g in zip(steps["own"], steps["group"], strict=True)),
        "race_group_own_mean_steps": race,
        "race_gain_over_group": mean["group"] / race,
        "steps": steps,
    }
    print(f"{n} stragglers alone, {args.tokens} tokens: mean decode steps to finish")
    for m in RACED:
        print(f"  {m:>5}: {mean[m]:.1f} steps, fastest for {100 * fastest[m] / n:.0f}%")
    print(
        f"  own fewer steps than group for {result['own_beats_group']} of {n}; "
        f"faster of group and own: {race:.1f} steps ({result['race_gain_over_group']:.3f}x group)"
    )
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    sides = ["none", *(s for s in args.sides.split(",") if s and s != "none")]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        raise SystemExit(f"unknown --sides {unknown}: use some of {SIDES}")
    model = build_model(args)
    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(0, args.vocab, size=args.prompt_len, dtype=np.int32)
        for _ in range(max(batches))
    ]
    t0 = time.perf_counter()
    refs, nll = siblings(model, args, prompts)
    print(
        f"siblings: {len(prompts)} groups x {args.group - 1} x {args.tokens} tokens in "
        f"{time.perf_counter() - t0:.1f} s; mean -logprob of a sampled token {nll:.2f} nats"
    )
    if args.race_methods:
        race = race_methods(model, args, prompts, refs)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": str(vars(args)), "race": race}, indent=2))
        return {"race": race, "mean_neg_logprob": nll}
    rows = []
    for b in batches:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        for _ in range(args.repeats):
            for side in sides:  # alternate, so load from other processes hits all alike
                runs[side].append(run_side(model, args, side, prompts[:b], refs))
        base_tokens = runs["none"][0]["tokens"]
        for side in sides:
            same = all(r["tokens"] == base_tokens for r in runs[side])
            first = runs[side][0]
            row = {
                "batch": b,
                "side": side,
                "decode_tokens_per_s": statistics.median(
                    r["decode_tokens_per_s"] for r in runs[side]
                ),
                "cpu_tokens_per_s": statistics.median(r["cpu_tokens_per_s"] for r in runs[side]),
                "draft_share": statistics.median(r["draft_share"] for r in runs[side]),
                "accepted_per_verification": first["accepted_per_verification"],
                "verifications": first["verifications"],
                "drafted": first["drafted"],
                "wasted": first["wasted"],
                "same_tokens_as_none": same,
            }
            rows.append(row)
            print(
                f"batch {b} {side}: {row['cpu_tokens_per_s']:.0f} tok/cpu-s, "
                f"{row['decode_tokens_per_s']:.0f} decode tok/s, "
                f"{row['accepted_per_verification']:.2f} accepted/verification",
                flush=True,
            )
    base = {r["batch"]: r for r in rows if r["side"] == "none"}
    print(
        f"{'batch':>5} {'side':>12} {'decode tok/s':>12} {'x none':>7} {'tok/cpu-s':>9} "
        f"{'x none':>7} {'acc/verif':>9} {'drafted':>8} {'wasted':>8} {'draft %':>7} same-tokens"
    )
    for r in rows:
        b = base[r["batch"]]
        r["speedup"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
        r["cpu_speedup"] = r["cpu_tokens_per_s"] / b["cpu_tokens_per_s"]
        print(
            f"{r['batch']:>5} {r['side']:>12} {r['decode_tokens_per_s']:>12.0f} "
            f"{r['speedup']:>7.2f} {r['cpu_tokens_per_s']:>9.0f} {r['cpu_speedup']:>7.2f} "
            f"{r['accepted_per_verification']:>9.2f} {r['drafted']:>8} {r['wasted']:>8} "
            f"{100 * r['draft_share']:>7.1f} {r['same_tokens_as_none']}"
        )
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "mean_neg_logprob": nll,
        "rows": rows,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "loadavg": os.getloadavg(),
        },
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
