"""The terminal view of a run: one line per training step, a live panel of buffers and
instances while it runs, and the final summary table (rich renderables; printing is the
CLI's business)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from staleness import BufferState

_COLOUR = {BufferState.WAITING: "yellow", BufferState.READY: "green", BufferState.STUCK: "red"}


def step_line(rec: dict[str, float], eta: int) -> str:
    """One short line per step (fits 100 columns)."""
    hist = " ".join(
        f"{k.rsplit('/', 1)[1]}:{int(v)}"
        for k, v in sorted(rec.items())
        if k.startswith("staleness/hist/")
    )
    reward = rec.get("rollout/reward_mean")
    shown = "  -  " if reward is None else f"{reward:5.3f}"
    return (
        f"step {int(rec['step']):>4} v{int(rec['version'])}  reward {shown}  "
        f"{rec['throughput/tokens_per_s']:7.1f} tok/s  "
        f"idle trainer {rec['trainer/idle_ratio']:3.0%} rollout "
        f"{rec.get('rollout/idle_ratio', 0.0):3.0%}  staleness [{hist}]"
    )


def live_panel(live: Any) -> Table:
    """Buffers as rows of slots (Figure 7) and one row per instance."""
    view = live.buffers
    table = Table(
        title=f"trainer at v{view.version} · PS v{live.ps_version} · eta={view.eta} · "
        f"{live.steps} steps · {live.rewarded} rewarded · {live.elapsed_s:.0f}s",
        show_header=True,
    )
    table.add_column("")
    table.add_column("state")
    table.add_column("slots (O occupied, r reserved, . free) / load")
    for b in view.buffers:
        slots = "".join("O" if e.kind == "occupied" else "r" for e in b.entries)
        slots += "." * max(b.capacity - len(b.entries), 0)
        table.add_row(f"buffer {b.version}", f"[{_COLOUR[b.state]}]{b.state}[/]", slots)
    for s in live.instances:
        table.add_row(
            f"instance {s.inst}",
            f"v{s.inst_version}",
            f"run {len(s.run_trajs)} · wait {len(s.wait_trajs)} · done {len(s.complete_trajs)} "
            f"· kv {s.kv_cache} tok",
        )
    return table


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
