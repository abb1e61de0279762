"""Real runs (``staleflow launch``) of the built-in agentic task (``data.task=calculator``,
multi-turn with a heavy-tailed tool latency) in one invocation: η = 0, η = 3 with
StaleFlow's strategies and η = 3 with the sticky in-flight-limited baseline (least-loaded
routing where a trajectory keeps its instance, vanilla synchronisation and migration:
``staleflow.sim.presets.system("sticky")``), side by side, repeated (issue #35).

    python experiments/launch_agentic.py --steps 4 --repeats 1          # a smoke run
    python experiments/launch_agentic.py --steps 8 --repeats 3 --json results/agentic.json

``staleflow+stream``: η = 3 with StaleFlow's strategies and RolloutPipe's streamed training
(``trainer.stream=true``), against the same baselines (which do not stream).

The policy is the micro model warmed up for a few seconds on tool-use demonstrations
(written once into ``--out``/policy), so that it writes tool calls and its trajectories
take more than one turn; the built-in tiny model's warm-up takes minutes on two cores.
Every run uses the same config apart from the variant (seed included). Per run: trained
tokens/s, episodes/s, tool calls and the seconds tools took (summed over episodes), model
turns per episode, the staleness histogram and its maximum (the bound holds if it is at
most η), the training reward, and the trainer's and rollout's idle shares, which say
which side binds. Then the medians over the repeats, and the ratios of the issue's
targets. Held-out success: the share of ``eval.problems`` held-out episodes (128 here;
problems the runs do not train on) the policy solves at the start and at the end of each
run, played turn by turn against the environment on a CPU copy (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staleflow.runfolder.run_summary import RunSummary

# variant -> (eta, config overrides)
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "eta0": (0, []),
    "staleflow": (3, []),
    # StaleFlow with RolloutPipe's streamed training (exact: docs/training.md)
    "staleflow+stream": (3, ["trainer.stream=true"]),
    "sticky": (
        3,
        [
            "coordinator.routing=sticky",
            "coordinator.synchronization=vanilla",
            "coordinator.migration=vanilla",
        ],
    ),
}
# the shared workload: the micro model's 256 positions hold a prompt, two turns, the
# calculator's answer and a final turn; Pareto tool latency, at least 0.3 s, a few
# up to 6 s (shape 1.1: a heavy tail; mean about 0.9 s)
BASE = [
    "dashboard=false",
    "data.task=calculator",
    "batch_size=4",
    "group_size=4",
    "rollout.max_response_tokens=200",
    "coordinator.period_s=0.05",
    "env.latency_scale_s=0.3",
    "env.latency_shape=1.1",
    "env.latency_cap_s=6",
    "eval.problems=128",  # held-out episodes scored at the start and the end of each run
]
POSITIONS = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides for every run"
    )
    p.add_argument("--steps", type=int, default=8, help="training steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant (alternating)")
    p.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="to run"
    )
    p.add_argument("--out", default="results/launch_agentic", help="run folders go here")
    p.add_argument("--json", help="write the runs and medians to this JSON file")
    p.add_argument(
        "--report",
        nargs="+",
        metavar="RUN_DIR",
        help="launch nothing: report these finished runs (their folders) instead",
    )
    return p.parse_args(argv)


def warm_policy(path: Path) -> None:
    """The micro model after 100 steps of 16 tool-use demonstrations at lr 1e-2 (about
    12 s on one idle thread; the launch test's 50 left about a quarter of its episodes
    calling the tool), saved at ``path`` unless it is there already."""
    if (path / "config.json").exists():
        return
    from dataclasses import replace

    from staleflow.data.synthetic import ArithmeticConfig
    from staleflow.envs.calculator import calculator_samples, demonstration
    from staleflow.envs.formats import PlainFormat
    from staleflow.models.checkpoint import save_pretrained
    from staleflow.models.presets import PRESETS
    from staleflow.models.tool_warmup import build_calculator_model, collate_demonstrations
    from staleflow.models.warmup import warmup

    model, tok = build_calculator_model(
        replace(PRESETS["micro"], max_position_embeddings=POSITIONS), seed=0
    )
    fmt, task = PlainFormat(tok), ArithmeticConfig.level(2, seed=7)

    def batch(step: int) -> Any:
        samples = calculator_samples(task, 16, 16 * step)
        return collate_demonstrations([demonstration(s, fmt, tok) for s in samples], tok.pad_id)

    warmup(model, tok, None, steps=100, batch_size=16, lr=1e-2, batches=batch, log_every=0)
    save_pretrained(model, tok, path)


def run_one(args: argparse.Namespace, variant: str, policy: Path) -> dict[str, Any]:
    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import launch

    eta, extra = VARIANTS[variant]
    overrides = [
        *BASE,
        f"model.checkpoint={policy}",
        *args.overrides,
        *extra,
        f"eta={eta}",
        f"steps={args.steps}",
        f"run_dir={args.out}",
    ]
    print(f"-- {variant} (eta={eta}): {args.steps} steps", file=sys.stderr, flush=True)
    result = launch(load_config(None, overrides))
    return summarise_run(variant, eta, result.summary, result.records, result.run_dir)


def from_folder(run_dir: Path) -> dict[str, Any]:
    """A finished run's row from its folder (``--report``): the variant from its config."""
    import yaml

    from staleflow.runfolder.layout import RunLayout
    from staleflow.runfolder.step_record import StepRecord

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    eta = int(cfg["eta"])
    variant = "eta0" if eta == 0 else cfg["coordinator"]["routing"]
    variant = "staleflow" if variant == "throughput" else variant
    variant += "+stream" if (cfg.get("trainer") or {}).get("stream") else ""
    summary = RunLayout(run_dir).read_summary()
    if summary is None:
        raise SystemExit(f"{run_dir}: no readable summary.json (did the run finish?)")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [StepRecord.from_flat(json.loads(line)) for line in lines if line.strip()]
    return summarise_run(variant, eta, summary, records, run_dir)


def summarise_run(
    variant: str, eta: int, s: RunSummary, records: list[Any], run_dir: Path
) -> dict[str, Any]:
    hist = dict(s.staleness_hist or {})
    episodes = sum(hist.values())
    if s.elapsed_s is None or s.staleness_max is None:
        raise SystemExit(f"{run_dir}: the run took no step, so it has no row; run it longer")
    known = [r for r in records if r.turns_mean is not None]
    return {
        "variant": variant,
        "eta": eta,
        "tokens_per_s": s.tokens_per_s,
        "episodes_per_s": episodes / s.elapsed_s,
        "elapsed_s": s.elapsed_s,
        "episodes": episodes,
        "tool_calls": sum(r.tool_calls or 0 for r in known),
        "tool_wait_s": sum(r.tool_wait_s or 0.0 for r in known),
        "turns_mean": statistics.fmean(r.turns_mean for r in known) if known else None,
        "staleness_hist": hist,
        "staleness_max": s.staleness_max,
        "within_eta": s.staleness_max <= eta,
        "reward_end": s.reward_end,
        "held_out_start": s.eval_reward_start,
        "held_out_end": s.eval_reward_end,
        "trainer_idle_ratio": s.trainer_idle_ratio,
        "rollout_idle_ratio": s.rollout_idle_ratio,
        "run_dir": str(run_dir),
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    keys = ("tokens_per_s", "episodes_per_s", "tool_wait_s", "tool_calls", "reward_end")
    keys += ("held_out_end", "trainer_idle_ratio", "rollout_idle_ratio")
    out: dict[str, dict[str, float]] = {}
    for v in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == v]
        out[v] = {
            k: statistics.median(vals)
            if (vals := [float(r[k]) for r in mine if r.get(k) is not None])
            else float("nan")
            for k in keys
        }
        out[v]["repeats"] = len(mine)
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    args = parse_args(argv)
    if args.report:
        runs = [from_folder(Path(d)) for d in args.report]
    else:
        policy = Path(args.out) / "policy"
        warm_policy(policy)
        runs = [run_one(args, v, policy) for _ in range(args.repeats) for v in args.variants]
    med = medians(runs)
    print(f"{'run':<16} {'tok/s':>8} {'ep/s':>6} {'tool s':>7} {'calls':>5} {'turns':>5} "
          f"{'reward':>6} {'held-out':>11} {'tr idle':>7} {'ro idle':>7}  staleness")  # fmt: skip
    for r in runs:
        print(
            f"{r['variant']:<16} {r['tokens_per_s']:>8.1f} {r['episodes_per_s']:>6.2f} "
            f"{r['tool_wait_s']:>7.1f} {r['tool_calls']:>5} {r['turns_mean'] or 0:>5.2f} "
            f"{_f(r['reward_end'], '>6.3f')} "
            f"{_f(r['held_out_start'], '>5.3f')}>{_f(r['held_out_end'], '<5.3f')} "
            f"{_f(r['trainer_idle_ratio'], '>7.1%')} "
            f"{_f(r['rollout_idle_ratio'], '>7.1%')}  {r['staleness_hist']}"
            + ("" if r["within_eta"] else "  OVER ETA")
        )
    ratios: dict[str, float] = {}
    for v, m in med.items():
        print(
            f"median {v:<16} tokens/s {m['tokens_per_s']:.1f}, episodes/s "
            f"{m['episodes_per_s']:.3f}, tool s {m['tool_wait_s']:.1f}, held-out success "
            f"at the end {m['held_out_end']:.3f} ({int(m['repeats'])} runs)"
        )
    for num, den, target in (
        ("staleflow", "eta0", 1.5),
        ("staleflow", "sticky", 1.15),
        ("staleflow+stream", "eta0", 1.5),
        ("staleflow+stream", "sticky", 1.15),
    ):
        if num in med and den in med and med[den]["tokens_per_s"] > 0:
            ratios[f"{num}/{den}"] = r_ = med[num]["tokens_per_s"] / med[den]["tokens_per_s"]
            print(f"tokens/s {num} / {den}: {r_:.2f}x (target >= {target}x)")
    print("every run within its eta:", all(r["within_eta"] for r in runs))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"runs": runs, "medians": med, "ratios": ratios}, indent=2) + "\n"
        )
    return 0


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
