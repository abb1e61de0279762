"""``staleflow launch``: a real run, its progress in the terminal and on the dashboard."""

from __future__ import annotations

import argparse
import logging
import sys

from rich.console import Console

from staleflow.commands.printing import print_text
from staleflow.config import load_config
from staleflow.dashboard.launch_hook import LaunchDashboard
from staleflow.progress import LatestLine
from staleflow.runfolder.step_record import StepRecord
from staleflow.runtime.driver.display import LaunchView, step_line, summary_table
from staleflow.runtime.driver.launch import LaunchError, check_placement, launch
from staleflow.runtime.driver.resume import ResumeError, check_resume


def _quiet_transformers() -> None:
    """transformers' per-file progress bars would interleave with the step lines."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    for flag, key in (("eta", "eta"), ("steps", "steps"), ("address", "address")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    if args.dashboard is not None:
        overrides.append(f"dashboard={'true' if args.dashboard else 'false'}")
    resume = None
    if args.resume is not None:
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
    console.print(summary_table(result.summary, cfg.eta, result.run_dir))
    if result.stopped:
        print_text(
            console,
            f"stopped after step {len(result.records)} of {cfg.steps}; the checkpoint is "
            f"{result.checkpoint}. Resume with: staleflow launch --resume {result.run_dir}",
        )
    return 0
