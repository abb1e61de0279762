"""``staleflow profile``: fit the embedded engine's cost model on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from staleflow.commands.printing import print_text
from staleflow.engines.profiling import overrides, profile_embedded, write_profile


def run(args: argparse.Namespace) -> int:
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
