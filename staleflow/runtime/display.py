"""The terminal view of a run: one line per training step, a live panel of buffers and
instances while it runs, and the final summary table (rich renderables; printing is the
CLI's business)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table

from staleflow.runtime.record import StepRecord
from staleflow.runtime.tables import buffers_table


def step_line(rec: StepRecord, eta: int) -> str:
    """One short line per step (fits 100 columns)."""
    hist = " ".join(f"{k}:{n}" for k, n in sorted(rec.staleness.items()))
    shown = "  -  " if rec.reward_mean is None else f"{rec.reward_mean:5.3f}"
    return (
        f"step {rec.step:>4} v{rec.version}  reward {shown}  "
        f"{rec.tokens_per_s or 0.0:7.1f} tok/s  "
        f"idle trainer {rec.trainer_idle_ratio or 0.0:3.0%} rollout "
        f"{rec.rollout_idle_ratio or 0.0:3.0%}  staleness [{hist}]"
    )


def live_panel(live: Any) -> Group:
    """Buffers as rows of slots (Figure 7) and one row per instance."""
    view = live.buffers
    buffers = buffers_table(
        view,
        title=f"trainer at v{view.version} · PS v{live.ps_version} · eta={view.eta} · "
        f"{live.steps} steps · {live.rewarded} rewarded · {live.elapsed_s:.0f}s",
    )
    instances = Table(show_header=False)
    for _ in range(3):
        instances.add_column("")
    for s in live.instances:
        instances.add_row(
            f"instance {s.inst}",
            f"v{s.inst_version}",
            f"run {len(s.run_trajs)} · wait {len(s.wait_trajs)} · done {len(s.complete_trajs)} "
            f"· kv {s.kv_cache} tok",
        )
    return Group(buffers, instances)


def summary_table(summary: dict[str, Any], eta: int) -> Table:
    table = Table(title=f"run summary (eta={eta})")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def fmt(v: Any, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    shares = summary.get("time_share", {})
    rows = [
        ("training steps", fmt(summary.get("steps"))),
        ("wall time (training)", f"{fmt(summary.get('elapsed_s'), '.1f')} s"),
        ("throughput", f"{fmt(summary.get('tokens_per_s'), ',.1f')} trained tokens/s"),
        (
            "mean reward, first → last quarter",
            f"{fmt(summary.get('reward_start'), '.3f')} → {fmt(summary.get('reward_end'), '.3f')}",
        ),
        (
            f"held-out reward ({summary.get('eval_problems', 0)} problems), start → end",
            f"{fmt(summary.get('eval_reward_start'), '.3f')} → "
            f"{fmt(summary.get('eval_reward_end'), '.3f')}",
        )
        if summary.get("eval_problems")  # scored only for the built-in task
        else None,
        (
            "staleness (V_buf - V_traj: trajectories)",
            " ".join(f"{k}:{v}" for k, v in summary.get("staleness_hist", {}).items()),
        ),
        ("trainer idle", fmt(summary.get("trainer_idle_ratio"), ".1%")),
        ("rollout idle", fmt(summary.get("rollout_idle_ratio"), ".1%")),
        (
            "rollout time in Pull / Route / Interrupt",
            " / ".join(fmt(shares.get(k), ".2%") for k in ("pull", "route", "interrupt")),
        ),
        (
            "rollout time in prefill / decode",
            " / ".join(fmt(shares.get(k), ".1%") for k in ("prefill", "decode")),
        ),
        ("run folder", str(summary.get("run_dir", ""))),
    ]
    for row in rows:
        if row is not None:
            table.add_row(*row)
    return table
