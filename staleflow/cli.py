"""The ``staleflow`` command line."""

from __future__ import annotations

import argparse
import sys

from staleness import BufferState, StalenessManager


def _buffers_table(m: StalenessManager):
    from rich.table import Table

    colour = {BufferState.WAITING: "yellow", BufferState.READY: "green", BufferState.STUCK: "red"}
    view = m.view()
    table = Table(title=f"staleness buffers (trainer at version {view.version}, eta={view.eta})")
    table.add_column("V_buf", justify="right")
    table.add_column("state")
    table.add_column("slots (O occupied, r reserved, . empty)")
    for b in view.buffers:
        slots = "".join("O" if e.kind == "occupied" else "r" for e in b.entries)
        slots += "." * (b.capacity - len(b.entries))
        table.add_row(str(b.version), f"[{colour[b.state]}]{b.state}[/]", slots)
    return table


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from staleflow.demo import run_demo

    console = Console()
    live = Live(console=console, refresh_per_second=8, transient=False) if args.live else None

    def on_tick(tick: int, m: StalenessManager) -> None:
        if live is not None and tick % 5 == 0:
            live.update(_buffers_table(m))

    if live is not None:
        live.start()
    try:
        result = run_demo(
            eta=args.eta,
            batch_size=args.batch_size,
            group_size=args.group_size,
            instances=args.instances,
            steps=args.steps,
            seed=args.seed,
            on_tick=on_tick,
        )
    finally:
        if live is not None:
            live.stop()
    console.print(
        f"{result.batches} batches consumed in {result.ticks} ticks; "
        f"{result.rejected_routes} routes refused by the staleness bound"
    )
    hist = " ".join(f"{k}:{v}" for k, v in sorted(result.staleness.items()))
    console.print(f"staleness of consumed groups (V_buf - V_traj: count): {hist}")
    worst = max(result.staleness, default=0)
    console.print(
        f"max staleness {worst} <= eta={args.eta}: {'ok' if worst <= args.eta else 'VIOLATED'}"
    )
    return 0 if worst <= args.eta else 1


def cmd_sim(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from staleflow.sim import PRESETS, simulate, system

    preset = PRESETS[args.preset]
    try:
        config = system(args.system, preset(eta=args.eta, steps=args.steps, seed=args.seed))
    except ValueError as exc:
        print(f"staleflow sim: {exc}", file=sys.stderr)
        return 2
    summary = simulate(config)
    table = Table(title=f"simulated {args.system} on {args.preset}, eta={args.eta}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("training steps", f"{summary.steps}" + (" (stalled)" if summary.stalled else "")),
        ("virtual time", f"{summary.seconds:,.0f} s"),
        ("throughput", f"{summary.tokens_per_s:,.0f} tokens/s"),
        ("throughput after warm-up", f"{summary.steady_tokens_per_s:,.0f} tokens/s"),
        (
            "rollout idle / prefill / pull",
            f"{summary.rollout_idle_ratio:.3f} / "
            f"{summary.rollout_prefill_ratio:.3f} / {summary.rollout_pull_ratio:.3f}",
        ),
        ("trainer idle", f"{summary.trainer_idle_ratio:.3f}"),
        (
            "staleness (V_buf - V_traj: groups)",
            " ".join(f"{k}:{v}" for k, v in sorted(summary.staleness.items())),
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary.as_dict(), f, indent=2)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console
    from rich.live import Live

    from staleflow.config import load_config
    from staleflow.runtime.display import live_panel, step_line, summary_table
    from staleflow.runtime.launch import LaunchError, launch

    overrides = list(args.overrides)
    for flag, key in (("eta", "eta"), ("steps", "steps"), ("address", "address")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, OSError) as exc:
        print(f"staleflow launch: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    live = Live(console=console, refresh_per_second=4, transient=True) if args.live else None

    def on_record(rec: dict[str, float]) -> None:
        console.print(step_line(rec, cfg.eta))

    def on_tick(state: object) -> None:
        if live is not None:
            live.update(live_panel(state))

    try:
        if live is not None:
            live.start()
        result = launch(
            cfg,
            on_record=on_record,
            on_tick=on_tick if live is not None else None,
            on_phase=lambda text: console.print(f"[dim]{text}[/]"),
        )
    except LaunchError as exc:
        console.print(f"[red]staleflow launch failed:[/] {exc}")
        return 1
    finally:
        if live is not None:
            live.stop()
    result.summary["run_dir"] = str(result.run_dir)
    console.print(summary_table(result.summary, cfg.eta))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staleflow",
        description="Asynchronous RL post-training with a strict per-trajectory staleness bound.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="watch the staleness protocol drive a toy cluster")
    demo.add_argument("--eta", type=int, default=3, help="staleness bound (0 = synchronous)")
    demo.add_argument("--batch-size", type=int, default=8, help="groups per training step")
    demo.add_argument("--group-size", type=int, default=4, help="trajectories per group")
    demo.add_argument("--instances", type=int, default=4, help="rollout instances")
    demo.add_argument("--steps", type=int, default=10, help="training steps to run")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--live", action="store_true", help="redraw the buffers while running")
    demo.set_defaults(func=cmd_demo)
    sim = sub.add_parser("sim", help="run one simulated job and print its summary")
    sim.add_argument("--preset", choices=["paper-6.5", "tiny"], default="tiny")
    sim.add_argument(
        "--system",
        default="staleflow",
        help="staleflow, vanilla, sync, or an ablation such as R1S0M1",
    )
    sim.add_argument("--eta", type=int, default=3, help="staleness bound (0 = synchronous)")
    sim.add_argument("--steps", type=int, default=8, help="training steps to simulate")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--json", help="also write the summary to this JSON file")
    sim.set_defaults(func=cmd_sim)
    launch = sub.add_parser(
        "launch",
        help="run real asynchronous RL (embedded CPU backends by default)",
        description="Run real, staleness-bounded asynchronous RL. With no arguments: the "
        "built-in arithmetic task, a small Qwen2 model (warmed up once and cached), 2 rollout "
        "instances, local Ray. Any setting can be given as key=value (e.g. rollout.instances=4 "
        "coordinator.routing=vanilla); see docs/configuration.md for every key.",
    )
    launch.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    launch.add_argument("--config", help="a YAML config file (overrides apply on top)")
    launch.add_argument("--eta", type=int, help="staleness bound (0 = synchronous on-policy)")
    launch.add_argument("--steps", type=int, help="training steps")
    launch.add_argument("--address", help="join this Ray cluster instead of a local one")
    launch.add_argument(
        "--live",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw buffers and instances while running",
    )
    launch.set_defaults(func=cmd_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (getattr(args, "eta", 0) or 0) < 0:
        print("staleflow: --eta must be >= 0 (0 = synchronous on-policy RL)", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
