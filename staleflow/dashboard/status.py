"""``staleflow status``: a terminal summary of a run, from the same sources the dashboard
reads (a run folder, or a live job found on a Ray cluster). Rich renderables only;
printing is the CLI's business."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from staleflow.dashboard.interface import LiveView, RunSource
from staleflow.recovery import describe_checkpoints
from staleflow.runfolder.layout import SUMMARY
from staleflow.runfolder.run_summary import RunSummary
from staleflow.runtime.driver.buffers_table import buffers_table


def status_view(source: RunSource, summary: RunSummary | None = None) -> Group:
    info, live, ps = source.info(), source.live(), source.ps()
    total = source.records(0, 1).total
    last_page = source.records(max(total - 1, 0), 1).items
    last = last_page[0] if last_page else None
    unit = "virtual s" if info.clock == "virtual" else "s"
    state = live.state or ("finished" if live.finished else "running")
    head = Table(title=f"{info.name} ({info.kind}, {state})", show_header=False)
    head.add_column("")
    head.add_column("", justify="right")
    rows = [
        ("eta", _v(info.eta)),
        ("batch x group", f"{_v(info.batch_size)} x {_v(info.group_size)}"),
        ("training steps", str(live.steps)),
        ("time", f"{live.elapsed_s:,.1f} {unit}"),
        ("trainer version", _v(live.buffers.version if live.buffers is not None else None)),
        ("PS version", _v(ps.latest if ps.latest is not None else live.ps_version)),
    ]
    if last is not None:
        rows += [
            ("throughput", f"{_num(last.tokens_per_s, ',.1f')} tokens/s"),
            ("mean reward (last step)", _num(last.reward_mean, ".3f")),
            ("trainer idle (last step)", _num(last.trainer_idle_ratio, ".0%")),
            ("rollout idle", _num(last.rollout_idle_ratio, ".0%")),
            (
                "staleness (last step)",
                " ".join(f"{k}:{n}" for k, n in sorted(last.staleness.items())) or "-",
            ),
        ]
    if live.ts is not None:
        ts = live.ts
        rows.append(
            ("TS queued / routed / completed", f"{ts.queued} / {ts.routed} / {ts.completed}")
        )
    for name, value in rows:
        head.add_row(name, value)
    parts: list[Any] = [head]
    if live.buffers is not None:
        parts.append(buffers_table(live.buffers))
    if any(d.snapshot is not None or d.version is not None for d in live.instances):
        parts.append(_instances(live))
    if summary is not None:
        parts.append(_summary(summary.to_json()))
    notes = [*info.notes, *live.notes]
    if notes:
        parts.append("\n".join(f"[dim]note: {n}[/]" for n in dict.fromkeys(notes)))
    return Group(*parts)


def _instances(live: LiveView) -> Table:
    table = Table(title="rollout instances")
    for name in ("inst", "version", "running", "waiting", "kv tokens", "measured tok/s", "idle"):
        table.add_column(name, justify="right")
    for d in live.instances:
        s = d.snapshot
        table.add_row(
            str(d.inst),
            _v(d.version),
            _v(len(s.run_trajs) if s is not None else None),
            _v(len(s.wait_trajs) if s is not None else None),
            _v(s.kv_cache if s is not None else None),
            _num(d.measured_tokens_per_s, ",.0f"),
            _num(d.idle_ratio, ".0%"),
        )
    return table


def _summary(summary: Mapping[str, Any]) -> Table:
    table = Table(title=SUMMARY)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in (
        "steps",
        "elapsed_s",
        "tokens_per_s",
        "reward_start",
        "reward_end",
        "staleness_hist",
        "trainer_idle_ratio",
        "rollout_idle_ratio",
    ):
        if key in summary:
            value = summary[key]
            text = f"{value:,.3f}" if isinstance(value, float) else str(value)
            table.add_row(key, text)
    return table


def _v(value: object) -> str:
    return "-" if value is None else str(value)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def resume_view(run_dir: str | Path) -> Table | str:
    """Where the run can resume from: its checkpoints, newest last (docs/recovery.md)."""

    found = describe_checkpoints(run_dir)
    if not found:
        return (
            "[dim]no checkpoint: this run cannot be resumed (checkpoint_every writes them; "
            "a run stopped with Ctrl-C or SIGTERM writes one)[/]"
        )
    table = Table(title=f"checkpoints: staleflow launch --resume {run_dir}")
    for name in ("checkpoint", "steps", "version", "written"):
        table.add_column(name)
    for ck in found:
        if ck.problem:
            table.add_row(ck.path.name, "-", "-", f"[red]{ck.problem}[/]")
        else:
            table.add_row(ck.path.name, _v(ck.steps), _v(ck.version), ck.written_at)
    return table
