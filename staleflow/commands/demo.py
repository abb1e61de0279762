"""``staleflow demo``: the staleness protocol driving a toy cluster."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.live import Live

from staleflow.demo import run_demo
from staleflow.runtime.driver.buffers_table import buffers_table
from staleness import StalenessManager


def run(args: argparse.Namespace) -> int:
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
