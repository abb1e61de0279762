"""Speculative decoding in the simulator: what telling the coordinator is worth.

Per seed, three runs of the same job (a preset, StaleFlow's strategies, eta): engines
without speculation (``off``); with the measured grouped-draft profile
(``staleflow.sim.speculation.MEASURED_GROUP``) and a coordinator that plans with the
plain cost model (``untold``, ``EngineCosts.tell_coordinator`` off); and with the
coordinator's cost model told the profile (``told``, as a real launch does). Prints the
trained tokens per second and the coordinator's estimate error (mean over instance
periods of |estimated - actual| / estimated decode time, ``Summary.estimate_error``).

    python experiments/sim_speculation.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from staleflow.sim import PRESETS, simulate, system
from staleflow.sim.speculation import MEASURED_GROUP

SIDES = ("off", "untold", "told")


def run(preset: str, name: str, eta: int, steps: int, seed: int, side: str) -> dict[str, float]:
    config = system(name, PRESETS[preset](eta, steps=steps, seed=seed))
    if side != "off":
        engine = replace(config.engine, speculation=MEASURED_GROUP, tell_coordinator=side == "told")
        config = replace(config, engine=engine)
    s = simulate(config)
    return {"tokens_per_s": s.tokens_per_s, "estimate_error": s.estimate_error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--system", default="staleflow")
    parser.add_argument("--eta", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    rows = []
    print(f"{args.system} on {args.preset}, eta={args.eta}, {args.steps} steps")
    print(f"{'seed':>4} {'side':>7} {'tok/s':>8} {'x off':>6} {'est. error':>10}")
    for seed in args.seeds:
        base = 0.0
        for side in SIDES:
            r = run(args.preset, args.system, args.eta, args.steps, seed, side)
            base = base or r["tokens_per_s"]
            rows.append({"seed": seed, "side": side, **r})
            print(
                f"{seed:>4} {side:>7} {r['tokens_per_s']:>8.0f} "
                f"{r['tokens_per_s'] / base:>6.2f} {r['estimate_error']:>10.3f}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
