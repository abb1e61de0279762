"""Real runs (``staleflow launch``) at several staleness bounds on the same machine and
workload, in one invocation: end-to-end throughput, reward, staleness and the share of
rollout time spent in Pull / Route / Interrupt (the paper's Table 3).

    python experiments/launch_eta_sweep.py                      # eta 3 vs 0, defaults
    python experiments/launch_eta_sweep.py --etas 0 1 3 --steps 30 --json results/eta.json
    python experiments/launch_eta_sweep.py --steps 10 rollout.instances=4
    python experiments/launch_eta_sweep.py --etas 0 --stream --repeats 3   # RolloutPipe

``--freshness`` runs every eta twice, with ``coordinator.freshness.enabled`` off and on
(eta as a ceiling, coordinator/freshness.py), and reports, per eta, the mean staleness,
the share of tokens the off-policy correction clipped or masked, throughput on / off and
the held-out reward side by side, over ``--seeds`` (issue 36's acceptance run)::

    python experiments/launch_eta_sweep.py --etas 3 --freshness --steps 200 --seeds 3 \
        --json results/freshness.json

``--stream`` runs every eta twice, with ``trainer.stream`` off and on (RolloutPipe's
complete-group pipelining), and reports the trainer's idle share, the mean step time
(at eta = 0 the time from a buffer's first route to the end of its step, RolloutPipe's
rollout-to-train-end) and the groups trained before their buffer was full.

Every run uses the same config apart from eta (seed included), so the ratio compares
the staleness bound alone. Runs go one after another; the machine is shared, so repeat
with ``--repeats`` and read the spread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runtime.driver.launch import RunResult


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides for every run"
    )
    p.add_argument("--config", help="YAML config file shared by every run")
    p.add_argument("--etas", type=int, nargs="+", default=[3, 0], help="staleness bounds to run")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--repeats", type=int, default=1, help="runs per eta (alternating)")
    p.add_argument("--stream", action="store_true", help="each eta with trainer.stream off and on")
    p.add_argument(
        "--freshness",
        action="store_true",
        help="each eta with coordinator.freshness.enabled off and on",
    )
    p.add_argument(
        "--seeds", type=int, default=1, help="run every variant with seeds 0..N-1 (seed=)"
    )
    p.add_argument("--out", default="results/launch", help="run folders go here")
    p.add_argument("--json", help="write the figures to this JSON file")
    return p.parse_args(argv)


def run_one(
    args: argparse.Namespace,
    eta: int,
    stream: bool = False,
    fresh: bool | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch

    # no dashboard: its poller would add RPCs to the runs being compared
    overrides = [
        "dashboard=false",
        *args.overrides,
        f"eta={eta}",
        f"steps={args.steps}",
        f"run_dir={args.out}",
        f"trainer.stream={str(stream).lower()}",
        *([f"coordinator.freshness.enabled={str(fresh).lower()}"] if fresh is not None else []),
        *([f"seed={seed}"] if seed is not None else []),
    ]
    cfg = load_config(args.config, overrides)
    print(
        f"-- eta={eta} stream={stream} freshness={fresh} seed={seed}: {args.steps} steps",
        file=sys.stderr,
        flush=True,
    )
    return sweep_row(launch(cfg), eta, stream, fresh, cfg.seed)


def sweep_row(
    result: RunResult, eta: int, stream: bool, fresh: bool | None, seed: int
) -> dict[str, Any]:
    """One run's row of the table and the JSON, from what ``launch`` returned: its
    summary (``summary.json``, typed) and its step records."""
    s = result.summary
    steps = [r.step_s for r in result.records[1:] if r.step_s is not None]  # not the first
    return {
        "eta": eta,
        "stream": stream,
        "freshness": bool(fresh),
        "seed": seed,
        "staleness_mean": s.staleness_mean,
        "corrected_frac": s.corrected_frac,
        "eval_reward_start": s.eval_reward_start,
        "eval_reward_end": s.eval_reward_end,
        "step_s_mean": sum(steps) / len(steps) if steps else float("nan"),
        "streamed_groups": sum(r.streamed_groups or 0 for r in result.records),
        "run_dir": str(result.run_dir),
        "tokens_per_s": s.tokens_per_s,
        "elapsed_s": s.elapsed_s,
        "reward_start": s.reward_start,
        "reward_end": s.reward_end,
        "staleness_hist": s.staleness_hist,
        "trainer_idle_ratio": s.trainer_idle_ratio,
        "rollout_idle_ratio": s.rollout_idle_ratio,
        "time_share": s.time_share,
    }


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-file bars would interleave with the output
    args = parse_args(argv)
    if any(e < 0 for e in args.etas):
        print("--etas must be >= 0", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("--seeds must be >= 1", file=sys.stderr)
        return 2
    streams = (False, True) if args.stream else (False,)
    freshness: tuple[bool | None, ...] = (False, True) if args.freshness else (None,)
    seeds: tuple[int | None, ...] = tuple(range(args.seeds)) if args.seeds > 1 else (None,)
    runs = [
        run_one(args, eta, stream, fresh, seed)
        for _ in range(args.repeats)
        for seed in seeds
        for eta in args.etas
        for stream in streams
        for fresh in freshness
    ]
    table = Table(title=f"staleflow launch, {args.steps} steps per run")
    for col in (
        "eta",
        "stream",
        "fresh",
        "seed",
        "tokens/s",
        "mean staleness",
        "clipped/masked",
        "step s",
        "streamed groups",
        "reward first→last",
        "trainer idle",
        "rollout idle",
        "Pull+Route+Interrupt",
        "prefill",
        "decode",
    ):
        table.add_column(col, justify="right")
    for r in runs:
        sh = r["time_share"]
        table.add_row(
            str(r["eta"]),
            "on" if r["stream"] else "off",
            "on" if r["freshness"] else "off",
            str(r["seed"]),
            f"{r['tokens_per_s']:.1f}",
            _fmt(r["staleness_mean"], ".2f"),
            _fmt(r["corrected_frac"], ".2%"),
            f"{r['step_s_mean']:.2f}",
            str(r["streamed_groups"]),
            f"{r['reward_start']:.3f}→{r['reward_end']:.3f}",
            f"{r['trainer_idle_ratio']:.1%}",
            f"{r['rollout_idle_ratio']:.1%}",
            f"{sh.get('commands', 0.0):.2%}",
            f"{sh.get('prefill', 0.0):.1%}",
            f"{sh.get('decode', 0.0):.1%}",
        )
    Console(width=max(Console().width, 120)).print(table)
    by_eta: dict[int, list[float]] = {}
    for r in runs:
        if not r["stream"] and not r["freshness"]:
            by_eta.setdefault(r["eta"], []).append(r["tokens_per_s"])
    means = {eta: sum(v) / len(v) for eta, v in by_eta.items()}
    ratios = {}
    if 0 in means:
        for eta, m in sorted(means.items()):
            if eta != 0:
                ratios[eta] = m / means[0]
                print(f"throughput eta={eta} / eta=0: {ratios[eta]:.2f}x")
    stream_gain = _stream_gains(runs) if args.stream else {}
    for eta, g in stream_gain.items():
        print(
            f"eta={eta}, stream on / off: tokens/s {g['tokens_per_s']:.3f}x, step time "
            f"{g['step_s']:.3f}x, trainer idle {g['idle_off']:.1%} -> {g['idle_on']:.1%}"
        )
    fresh_cmp = freshness_comparison(runs) if args.freshness else {}
    for eta, c in fresh_cmp.items():
        print(
            f"eta={eta}, freshness off | on over {c['seeds']} seed(s): mean staleness "
            f"{_fmt(c['staleness_off'], '.2f')} | {_fmt(c['staleness_on'], '.2f')}, clipped or "
            f"masked {_fmt(c['corrected_off'], '.2%')} | {_fmt(c['corrected_on'], '.2%')}, "
            f"tokens/s on / off {c['tokens_per_s_ratio']:.3f}x "
            f"({_spread(c['tokens_per_s_ratios'])}), held-out reward at the end "
            f"{_fmt(c['eval_end_off'], '.3f')} | {_fmt(c['eval_end_on'], '.3f')} "
            f"(per seed {_spread(c['eval_end_off_seeds'])} | {_spread(c['eval_end_on_seeds'])})"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "runs": runs,
                    "mean_tokens_per_s": means,
                    "ratio_vs_eta0": ratios,
                    "stream_gain": stream_gain,
                    "freshness": fresh_cmp,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread(values: list[float | None]) -> str:
    return " ".join(_fmt(v, ".3f") for v in values)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def freshness_comparison(runs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per eta (not streamed): freshness off against on, seed by seed (the same seed
    pairs the same config), then means over the seeds (repeats averaged first)."""
    out: dict[int, dict[str, Any]] = {}
    for eta in sorted({r["eta"] for r in runs}):

        def side(fresh: bool, key: str, seed: int, eta: int = eta) -> float | None:
            return _mean(
                [
                    r[key]
                    for r in runs
                    if r["eta"] == eta
                    and not r["stream"]
                    and r["freshness"] == fresh
                    and r["seed"] == seed
                ]
            )

        seeds = sorted({r["seed"] for r in runs if r["eta"] == eta})
        ratios = []
        for seed in seeds:
            off, on = side(False, "tokens_per_s", seed), side(True, "tokens_per_s", seed)
            ratios.append(on / off if on is not None and off else None)
        per = {
            key: {fresh: [side(fresh, key, seed) for seed in seeds] for fresh in (False, True)}
            for key in ("staleness_mean", "corrected_frac", "eval_reward_end", "tokens_per_s")
        }
        known = [x for x in ratios if x is not None]
        out[eta] = {
            "seeds": len(seeds),
            "staleness_off": _mean(per["staleness_mean"][False]),
            "staleness_on": _mean(per["staleness_mean"][True]),
            "corrected_off": _mean(per["corrected_frac"][False]),
            "corrected_on": _mean(per["corrected_frac"][True]),
            "tokens_per_s_off": _mean(per["tokens_per_s"][False]),
            "tokens_per_s_on": _mean(per["tokens_per_s"][True]),
            "tokens_per_s_ratio": sum(known) / len(known) if known else float("nan"),
            "tokens_per_s_ratios": ratios,
            "eval_end_off": _mean(per["eval_reward_end"][False]),
            "eval_end_on": _mean(per["eval_reward_end"][True]),
            "eval_end_off_seeds": per["eval_reward_end"][False],
            "eval_end_on_seeds": per["eval_reward_end"][True],
        }
    return out


def _stream_gains(runs: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per eta: streamed over not streamed (means over repeats) of tokens/s and step
    time, and the trainer's idle share of each."""

    def mean(eta: int, stream: bool, key: str) -> float:
        values = [
            r[key] for r in runs if r["eta"] == eta and r["stream"] == stream and not r["freshness"]
        ]
        return sum(values) / len(values)

    return {
        eta: {
            "tokens_per_s": mean(eta, True, "tokens_per_s") / mean(eta, False, "tokens_per_s"),
            "step_s": mean(eta, True, "step_s_mean") / mean(eta, False, "step_s_mean"),
            "idle_off": mean(eta, False, "trainer_idle_ratio"),
            "idle_on": mean(eta, True, "trainer_idle_ratio"),
        }
        for eta in sorted({r["eta"] for r in runs})
    }


if __name__ == "__main__":
    sys.exit(main())
