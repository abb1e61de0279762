"""The ``staleflow`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

# The module of each subcommand, imported only when that command runs: ``staleflow --help``
# and the parser load none of them (the launch module alone pulls in the runtime).
COMMANDS = {
    name: f"staleflow.commands.{name}"
    for name in ("demo", "sim", "launch", "dashboard", "status", "scale", "profile")
}


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
    sim = sub.add_parser(
        "sim",
        help="run one simulated job and print its summary",
        description="Simulate one training job on a virtual clock: the real staleness "
        "manager, trajectory server and coordinator drive simulated rollout instances and "
        "a simulated trainer (pure Python, no Ray, torch or GPU). Prints throughput, idle "
        "ratios and the staleness distribution. Presets: tiny (4 instances, seconds of "
        "virtual time per step) and paper-6.5 (Qwen3-30B-A3B on 128 H20 GPUs, paper "
        "section 6.5). See docs/simulator.md; to watch one live: staleflow dashboard --sim.",
    )
    sim.add_argument(
        "--preset",
        choices=["paper-6.5", "tiny"],
        default="tiny",
        help="simulated cluster and workload (default: tiny)",
    )
    sim.add_argument(
        "--workload",
        help="one of the experiment matrix's workloads instead of --preset, e.g. preset-20k, "
        "heavy-tail or the agentic search-agent and swe-agent (docs/simulator.md, "
        "docs/simulator_agentic.md; a wrong name lists them all)",
    )
    sim.add_argument(
        "--rollout-gpus",
        type=int,
        help="with --workload: the GPUs that roll out (default half)",
    )
    sim.add_argument(
        "--gpus",
        type=int,
        help="with --workload: the cluster's GPUs, rollout and training together (default "
        "the workload's, 128 for most; e.g. 256 with --rollout-gpus 128)",
    )
    sim.add_argument(
        "--small",
        action="store_true",
        help="with --workload: the same shape at the tiny preset's scale (seconds to run)",
    )
    sim.add_argument(
        "--system",
        default="staleflow",
        help="staleflow, vanilla, sync, or an ablation such as R1S0M1",
    )
    sim.add_argument("--eta", type=int, default=3, help="staleness bound (0 = synchronous)")
    sim.add_argument("--steps", type=int, default=8, help="training steps to simulate")
    sim.add_argument("--seed", type=int, default=0, help="seed of the simulated workload")
    sim.add_argument("--json", help="also write the summary to this JSON file")
    launch = sub.add_parser(
        "launch",
        help="run real asynchronous RL (embedded CPU backends by default)",
        description="Run real, staleness-bounded asynchronous RL. With no arguments: the "
        "built-in arithmetic task, a small Qwen2 model (warmed up once and cached), 2 rollout "
        "instances, local Ray. Any setting can be given as key=value (e.g. rollout.instances=4 "
        "coordinator.routing=vanilla); docs/launch.md says how to list every key.",
    )
    launch.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    launch.add_argument("--config", help="a YAML config file (overrides apply on top)")
    launch.add_argument("--eta", type=int, help="staleness bound (0 = synchronous on-policy)")
    launch.add_argument("--steps", type=int, help="training steps")
    launch.add_argument(
        "--address",
        help="run on this Ray cluster: auto (the one this node belongs to) or host:port "
        "(default: start a local Ray); see docs/cluster.md",
    )
    launch.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a run from its newest checkpoint (or from RUN_DIR/checkpoints/step-N): "
        "its config.yaml with any key=value overrides that keep the protocol (eta, batch, "
        "group size, redundancy); every partial trajectory goes on from its tokens. Ctrl-C "
        "or SIGTERM stops a run this way: it checkpoints first (docs/recovery.md)",
    )
    launch.add_argument(
        "--check",
        action="store_true",
        help="print the placement plan and where it would go on the cluster, then stop "
        "(exit 1 naming what is missing when the cluster cannot hold it)",
    )
    launch.add_argument(
        "--live",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="in a terminal, draw progress bars, buffers and instances while running "
        "(--no-live: plain progress lines, as when output is not a terminal)",
    )
    launch.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve the web dashboard while running (on by default; --no-dashboard is "
        "dashboard=false; port: dashboard_port=...)",
    )
    _add_dashboard(sub)
    _add_status(sub)
    _add_scale(sub)
    _add_profile(sub)
    return parser


def _add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", nargs="?", help="a run folder (as printed by staleflow launch)")
    p.add_argument("--address", help="a Ray cluster running staleflow launch (e.g. auto)")
    p.add_argument("--run", help="which run on that cluster (its run folder's name)")
    p.add_argument("--run-dir", help="the run's folder, for its config (default: runs/<run>)")


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="serve the web dashboard of a run folder, a live run or a simulated run",
        description="Serve the REST API and live web page of one run: a run folder "
        "(finished or being written), a running staleflow launch on a Ray cluster "
        "(--address), or a simulated run (--sim PRESET). See docs/dashboard.md.",
    )
    _add_source_args(p)
    p.add_argument("--sim", choices=["paper-6.5", "tiny"], help="simulate this preset live")
    p.add_argument("--system", default="staleflow", help="with --sim: staleflow, vanilla, ...")
    p.add_argument("--eta", type=int, help="with --sim: staleness bound (preset default)")
    p.add_argument("--steps", type=int, default=1000, help="with --sim: training steps")
    p.add_argument("--seed", type=int, default=0, help="with --sim: seed")
    p.add_argument(
        "--speed", type=float, default=10.0, help="with --sim: virtual seconds per wall second"
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="port (0: any free one; default 8266, or a free one if that is taken)",
    )
    p.add_argument(
        "--token", help="enable actions (e.g. pausing a simulation) for requests with this token"
    )


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="print a summary of a run folder or a live run",
        description="Print one summary of a run: its progress, last step, buffers and "
        "instances (live runs) and summary.json (finished runs).",
    )
    _add_source_args(p)


def _add_scale(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scale",
        help="add or remove rollout instances of a running staleflow launch",
        description="Elastic rollout: ask a running run for a number of rollout instances. "
        "A new instance Pulls the current weights and is routed to at the next coordinator "
        "cycle; a removed one is interrupted first, so its partial responses go back to the "
        "trajectory server whole (docs/recovery.md).",
    )
    p.add_argument(
        "run", help="the run's folder (it reads RUN/live.json), or its name with --address"
    )
    p.add_argument("--address", help="the Ray cluster of the run (default: from RUN/live.json)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--instances", type=int, help="the number of rollout instances wanted")
    group.add_argument("--add", type=int, help="this many more")
    group.add_argument("--remove", type=int, help="this many fewer")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="fit the cost model of the embedded rollout engine on this machine",
        description="Time decode steps of the embedded engine on the built-in model at "
        "several batch and KV sizes, fit the cost model (k1..k4, Appendix B) and save it "
        "as a config snippet for staleflow launch --config.",
    )
    p.add_argument("--preset", default="tiny", help="built-in model size (tiny, micro, ...)")
    p.add_argument("--output", "-o", default="cost_model.yaml", help="where to save the fit")
    p.add_argument("--max-running", type=int, default=64, help="engine batch slots")
    p.add_argument("--kv-budget", type=int, default=16384, help="engine KV budget (tokens)")
    p.add_argument("--running", default="1,2,4,8,16,32,64", help="running counts to time")
    p.add_argument("--lengths", default="16,64,160,320", help="prompt lengths to time")
    p.add_argument("--steps", type=int, default=4, help="timed decode steps per point")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Like ``parse_args``, except that ``key=value`` overrides of ``launch`` may also come
    after an option (``launch --eta 3 --no-dashboard seed=1``), which argparse alone
    refuses once an option has interrupted a positional list."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [a for a in extra if a.startswith("-") or "=" not in a]
        if stray or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (getattr(args, "eta", 0) or 0) < 0:
        print("staleflow: --eta must be >= 0 (0 = synchronous on-policy RL)", file=sys.stderr)
        return 2
    command = importlib.import_module(COMMANDS[args.command])
    return int(command.run(args))


if __name__ == "__main__":
    sys.exit(main())
