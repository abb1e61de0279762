"""Freshness off against on in the simulator's experiment scripts (issue 36): StaleFlow
with the freshness rule (coordinator/freshness.py) against StaleFlow without, seed by seed
on the same split (``experiments/sim_matrix.py --freshness``)."""

from __future__ import annotations

from typing import Any

from staleflow.sim.report import spread

FRESH_SYSTEM = "staleflow+fresh"  # StaleFlow with coordinator.freshness on
TRAINER_BINDS = 0.9  # the trainer's busy share (steady, freshness off) above which it binds
# Where the trainer binds, a batch is sampled while it trains on the one before, with the
# weights of at best one version back: a mean staleness at or below 1 can go lower only by
# making the trainer wait for its data, which the rule never does.
FLOOR = 1.0
# The rule can take off only the steps a batch waits for the trainer once it is complete
# (``ready_wait_versions``): a batch completed while the trainer trains on the one before
# waits 1, and a trainer-bound run whose batches wait no more than that (within noise) has
# nothing for the rule to remove: the rollout is only just keeping up, so every group
# already starts as late as it can without the trainer waiting.
WAIT_FLOOR = 1.15


def _find(rows: list[dict[str, Any]], w: str, eta: int, seed: int) -> dict[str, Any] | None:
    for r in rows:
        if (r["workload"], r["system"], r["eta"], r["seed"]) == (w, "staleflow", eta, seed):
            return r
    return None


def freshness_cells(
    rows: list[dict[str, Any]], workloads: list[str], etas: list[int]
) -> list[dict[str, Any]]:
    """Per (workload, eta): StaleFlow with the freshness rule on against off, seed by
    seed on the same split, then the mean over the seeds."""
    out = []
    for w in workloads:
        for eta in etas:
            ratios, stale_off, stale_on, busy = [], [], [], []
            wait_off: list[float] = []
            wait_on: list[float] = []
            for on in (r for r in rows if r["system"] == FRESH_SYSTEM):
                if (on["workload"], on["eta"]) != (w, eta):
                    continue
                off = _find(rows, w, eta, on["seed"])
                if off is None or not off["tokens_per_s"]:
                    continue
                ratios.append(on["tokens_per_s"] / off["tokens_per_s"])
                stale_off.append(off["staleness_mean"])
                stale_on.append(on["staleness_mean"])
                busy.append(off["trainer_busy_steady"])
                if "ready_wait_versions" in off:  # journals from before it was measured
                    wait_off.append(off["ready_wait_versions"])
                if "ready_wait_versions" in on:
                    wait_on.append(on["ready_wait_versions"])
            if not ratios:
                continue
            mean = lambda v: sum(v) / len(v)  # noqa: E731
            out.append(
                {
                    "workload": w,
                    "eta": eta,
                    "seeds": len(ratios),
                    "ratio": float(mean(ratios)),
                    "ratio_min": float(min(ratios)),
                    "ratio_text": spread(ratios, "{:.3f}"),
                    "staleness_off": float(mean(stale_off)),
                    "staleness_on": float(mean(stale_on)),
                    "trainer_busy_steady_off": float(mean(busy)),
                    "trainer_binds": bool(mean(busy) >= TRAINER_BINDS),
                    "ready_wait_off": float(mean(wait_off)) if wait_off else None,
                    "ready_wait_on": float(mean(wait_on)) if wait_on else None,
                }
            )
    return out


def freshness_verdicts(cells: list[dict[str, Any]]) -> list[str]:
    """Issue 36's requirements of the simulator, naming the cells that fail."""
    if not cells:
        return []
    slow = [c for c in cells if c["ratio"] < 0.98]
    bound = [c for c in cells if c["trainer_binds"]]
    floor = [c for c in bound if _at_floor(c)]
    stale = [c for c in bound if not _at_floor(c) and not c["staleness_on"] < c["staleness_off"]]
    name = lambda c: f"{c['workload']} eta={c['eta']}"  # noqa: E731
    return [
        f"verdict: freshness on >= 0.98x off in every cell (mean over seeds): {len(cells)} "
        "cells, "
        + (
            "PASS"
            if not slow
            else "FAIL in " + "; ".join(f"{name(c)} {c['ratio_text']}" for c in slow)
        ),
        f"verdict: mean staleness lower with freshness on where the trainer binds (busy >= "
        f"{TRAINER_BINDS}) unless it is at its floor with the rule off (a mean staleness "
        f"<= {FLOOR:g}, or batches waiting <= {WAIT_FLOOR:g} steps for the trainer once "
        f"complete: a batch sampled while the trainer trains on the one before is a version "
        f"old): {len(bound)} cells"
        + (f", {len(floor)} of them at that floor" if floor else "")
        + ", "
        + (
            "PASS"
            if not stale
            else "FAIL in "
            + "; ".join(
                f"{name(c)} {c['staleness_off']:.2f} -> {c['staleness_on']:.2f}" for c in stale
            )
        ),
    ]


def _at_floor(cell: dict[str, Any]) -> bool:
    wait = cell.get("ready_wait_off")
    return cell["staleness_off"] <= FLOOR or (wait is not None and wait <= WAIT_FLOOR)


def print_freshness(cells: list[dict[str, Any]]) -> None:
    print("\nFreshness off | on (StaleFlow, same split and seeds)")
    print(
        f"{'workload':11s} {'eta':>3s} {'on / off tok/s':>26s} {'mean staleness off | on':>24s}"
        f" {'batch waits off | on':>21s} {'trainer busy (off)':>19s}"
    )
    for c in cells:
        stale = f"{c['staleness_off']:.2f} | {c['staleness_on']:.2f}"
        waits = " | ".join(
            "-" if c.get(k) is None else f"{c[k]:.2f}" for k in ("ready_wait_off", "ready_wait_on")
        )
        busy = f"{c['trainer_busy_steady_off']:.2f}" + (" binds" if c["trainer_binds"] else "")
        print(
            f"{c['workload']:11s} {c['eta']:>3d} {c['ratio_text']:>26s} {stale:>24s}"
            f" {waits:>21s} {busy:>19s}"
        )
