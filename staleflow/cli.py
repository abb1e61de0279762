"""The ``staleflow`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from staleness import StalenessManager


def print_text(console: Any, text: str, *, style: str = "", label: str = "") -> None:
    """Print ``text`` verbatim, after ``label`` in ``style`` when given. Messages are never
    read as rich markup: "pip install -e '.[megatron]'" printed as markup loses its extra
    (rich takes ``[megatron]`` for a style tag), and a path may hold brackets too."""
    from rich.text import Text

    line = Text.assemble((label, style), " ", text) if label else Text(text, style=style)
    console.print(line, highlight=False)


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from staleflow.demo import run_demo
    from staleflow.runtime.driver.buffers_table import buffers_table

    console = Console()
    live = Live(console=console, refresh_per_second=8, transient=False) if args.live else None

    def on_tick(tick: int, m: StalenessManager) -> None:
        if live is not None and tick % 5 == 0:
            live.update(buffers_table(m.view()))

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


def _quiet_transformers() -> None:
    """transformers' per-file progress bars would interleave with the step lines."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def cmd_launch(args: argparse.Namespace) -> int:
    import logging

    from rich.console import Console

    from staleflow.config import load_config
    from staleflow.progress import LatestLine
    from staleflow.runfolder.step_record import StepRecord
    from staleflow.runtime.driver.display import LaunchView, step_line, summary_table
    from staleflow.runtime.driver.launch import LaunchError, check_placement, launch

    overrides = list(args.overrides)
    for flag, key in (("eta", "eta"), ("steps", "steps"), ("address", "address")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    if args.dashboard is not None:
        overrides.append(f"dashboard={'true' if args.dashboard else 'false'}")
    resume = None
    if args.resume is not None:
        from staleflow.runtime.driver.resume import ResumeError, check_resume

        if args.config:
            print(
                "staleflow launch: --resume reads the run's own config.yaml; give changes "
                "as key=value overrides instead of --config",
                file=sys.stderr,
            )
            return 2
        try:  # before anything is created: a refused resume changes nothing
            cfg, resume = check_resume(args.resume, overrides)
        except ResumeError as exc:
            print(f"staleflow launch --resume: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            cfg = load_config(args.config, overrides)
        except (ValueError, OSError) as exc:
            print(f"staleflow launch: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _quiet_transformers()
    console = Console()

    def say(text: str) -> None:
        print_text(console, text, style="dim")

    if args.check:
        try:
            check_placement(cfg, say)
        except LaunchError as exc:
            print_text(console, str(exc), label="staleflow launch --check:", style="red")
            return 1
        print_text(console, "the cluster holds this placement")
        return 0

    dashboard = None
    if cfg.dashboard:  # the runtime does not import the dashboard: it is handed in
        from staleflow.dashboard.launch_hook import LaunchDashboard

        dashboard = LaunchDashboard(cfg, say)

    def on_phase(text: str) -> None:
        say(text)
        if dashboard is not None:
            dashboard.phase(text)

    def on_record(rec: StepRecord) -> None:
        console.print(step_line(rec, cfg.eta))

    try:
        # live bars and the buffers panel in a terminal, plain progress lines in a log
        with LaunchView(console, live=args.live) as view:
            if dashboard is not None:  # the page shows the waits' progress too, once up
                view.progress.add_renderer(LatestLine(dashboard.phase))
            result = launch(
                cfg,
                on_record=on_record,
                on_tick=view.on_tick if view.terminal is not None else None,
                on_phase=on_phase,
                resume=resume,
                handle_signals=True,
                on_started=dashboard,
                progress=view.progress,
            )
    except LaunchError as exc:
        print_text(console, str(exc), label="staleflow launch failed:", style="red")
        return 1
    except KeyboardInterrupt:  # Ctrl-C: launch's teardown has run; no traceback
        console.print("[yellow]staleflow launch: interrupted, the actors stopped[/]")
        return 130
    result.summary["run_dir"] = str(result.run_dir)
    console.print(summary_table(result.summary, cfg.eta))
    if result.stopped:
        print_text(
            console,
            f"stopped after step {len(result.records)} of {cfg.steps}; the checkpoint is "
            f"{result.checkpoint}. Resume with: staleflow launch --resume {result.run_dir}",
        )
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    import logging

    try:
        from staleflow.dashboard.app import create_app
        from staleflow.dashboard.server import DEFAULT_PORT, DashboardServer, bind, bind_preferred
    except ImportError as exc:
        from staleflow.install import missing

        print(
            f"staleflow dashboard: {missing('fastapi, fastapi-offline or uvicorn', exc)}",
            file=sys.stderr,
        )
        return 2
    from staleflow.dashboard.sources import SourceError, open_source

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("staleflow.dashboard").warning(
            "serving on %s: anyone who can reach this port can read the run", args.host
        )
    try:
        sock = (
            bind_preferred(args.host, DEFAULT_PORT)
            if args.port is None
            else bind(args.host, args.port)
        )
    except OSError as exc:
        print(f"staleflow dashboard: {exc}", file=sys.stderr)
        return 2
    try:
        source = open_source(
            args.folder,
            address=args.address,
            run=args.run,
            run_dir=args.run_dir,
            sim=args.sim,
            sim_options={
                "system": args.system,
                "eta": args.eta,
                "steps": args.steps,
                "seed": args.seed,
                "speed": args.speed,
            },
        )
    except SourceError as exc:
        sock.close()
        print(f"staleflow dashboard: {exc}", file=sys.stderr)
        return 2
    server = DashboardServer(create_app(source, token=args.token), sock)
    print(f"staleflow dashboard at {server.url} (API docs at {server.url}docs; Ctrl-C stops)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        source.close()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from staleflow.dashboard.sources import SourceError, open_source
    from staleflow.dashboard.status import status_view

    try:
        source = open_source(
            args.folder, address=args.address, run=args.run, run_dir=args.run_dir, poll=False
        )
    except SourceError as exc:
        print(f"staleflow status: {exc}", file=sys.stderr)
        return 2
    try:
        summary = getattr(source, "summary", None)
        console = Console()
        console.print(status_view(source, summary))
        folder = args.folder or args.run_dir
        if folder:
            from staleflow.dashboard.status import resume_view

            console.print(resume_view(folder))
    finally:
        source.close()
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from staleflow.engines.profiling import overrides, profile_embedded, write_profile

    console = Console()
    try:
        running = _ints(args.running, "--running")
        lengths = _ints(args.lengths, "--lengths")
        if Path(args.output).is_dir():
            raise ValueError(
                f"--output={args.output!r} is a folder: give a file, e.g. cost_model.yaml"
            )
    except ValueError as exc:
        print(f"staleflow profile: {exc}", file=sys.stderr)
        return 2
    print_text(
        console,
        f"profiling the embedded engine on the built-in {args.preset} model: "
        f"running {running} x prompt lengths {lengths}, {args.steps} timed steps each",
        style="dim",
    )
    try:
        result = profile_embedded(
            args.preset,
            max_running=args.max_running,
            kv_budget=args.kv_budget,
            running=running,
            lengths=lengths,
            steps=args.steps,
            seed=args.seed,
            num_threads=args.threads,
            on_sample=lambda s: console.print(
                f"  n={s.running:>3}  kv={s.kv_cache:>8.0f} tokens  {s.step_latency * 1e3:8.3f} ms/step"
            ),
        )
    except (ValueError, KeyError) as exc:
        print(f"staleflow profile: {exc}", file=sys.stderr)
        return 2
    try:
        path = write_profile(result, args.output)
    except OSError as exc:
        print(f"staleflow profile: cannot save the fit to {args.output}: {exc}", file=sys.stderr)
        print("the fit, as overrides: " + " ".join(overrides(result)), file=sys.stderr)
        return 1
    fit = result.fit
    m = fit.model
    console.print(
        f"k1={m.k1:.3g} s/token  k2={m.k2:.3g} s  k3={m.k3:.3g} s/trajectory  k4={m.k4:.3g} s  "
        f"(mean relative error {fit.mean_relative_error:.1%}, knee at {fit.knee:.1f} running; "
        f"{result.seconds:.0f} s)"
    )
    print_text(console, f"saved to {path}; use it with: staleflow launch --config {path}")
    print_text(console, "or as overrides: " + " ".join(overrides(result)))
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r}: give positive integers, e.g. 1,2,4,8")
    return values


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
        "--system",
        default="staleflow",
        help="staleflow, vanilla, sync, or an ablation such as R1S0M1",
    )
    sim.add_argument("--eta", type=int, default=3, help="staleness bound (0 = synchronous)")
    sim.add_argument("--steps", type=int, default=8, help="training steps to simulate")
    sim.add_argument("--seed", type=int, default=0, help="seed of the simulated workload")
    sim.add_argument("--json", help="also write the summary to this JSON file")
    sim.set_defaults(func=cmd_sim)
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
    launch.set_defaults(func=cmd_launch)
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
    p.set_defaults(func=cmd_dashboard)


def _add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="print a summary of a run folder or a live run",
        description="Print one summary of a run: its progress, last step, buffers and "
        "instances (live runs) and summary.json (finished runs).",
    )
    _add_source_args(p)
    p.set_defaults(func=cmd_status)


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
    p.set_defaults(func=cmd_scale)


def cmd_scale(args: argparse.Namespace) -> int:
    from staleflow.runtime.driver.elastic import ScaleError, request_scale

    try:
        print(request_scale(args.run, args.address, args.instances, args.add, args.remove))
    except ScaleError as exc:
        print(f"staleflow scale: {exc}", file=sys.stderr)
        return 2
    return 0


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
    p.set_defaults(func=cmd_profile)


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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
