"""The terminal view of a run: live bars of the waits before training, one line per
training step, a live panel of buffers and instances while it runs, and the final summary
table (rich renderables; printing is the CLI's business)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from staleflow.progress import (
    PhaseState,
    PlainLines,
    Progress,
    count_text,
    duration,
    left_text,
    metric_text,
    progress_line,
)
from staleflow.runfolder.step_record import StepRecord
from staleflow.runtime.driver.buffers_table import buffers_table

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from staleflow.runfolder.run_summary import RunSummary
    from staleflow.runtime.controller.plane_records import LiveState


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


def live_panel(live: LiveState) -> Group:
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


def summary_table(summary: RunSummary, eta: int, run_dir: Path | str = "") -> Table:
    """The final table of ``staleflow launch``: the run's summary (``summary.json``) and
    where its folder is."""
    table = Table(title=f"run summary (eta={eta})")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def fmt(v: object, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    s = summary
    shares = s.time_share or {}
    rows = [
        ("training steps", fmt(s.steps)),
        ("wall time (training)", f"{fmt(s.elapsed_s, '.1f')} s"),
        ("throughput", f"{fmt(s.tokens_per_s, ',.1f')} trained tokens/s"),
        (
            "mean reward, first → last quarter",
            f"{fmt(s.reward_start, '.3f')} → {fmt(s.reward_end, '.3f')}",
        ),
        (
            f"held-out reward ({s.eval_problems} problems), start → end",
            f"{fmt(s.eval_reward_start, '.3f')} → {fmt(s.eval_reward_end, '.3f')}",
        )
        if s.eval_problems  # scored only for the built-in task
        else None,
        _evaluation_row(s.eval_last, s.eval_best),
        (
            "staleness (V_buf - V_traj: trajectories)",
            " ".join(f"{k}:{v}" for k, v in (s.staleness_hist or {}).items()),
        ),
        (
            "mean staleness; tokens clipped or masked",
            f"{fmt(s.staleness_mean, '.2f')}; {fmt(s.corrected_frac, '.2%')}",
        ),
        ("trainer idle", fmt(s.trainer_idle_ratio, ".1%")),
        ("rollout idle", fmt(s.rollout_idle_ratio, ".1%")),
        (
            "rollout time in Pull / Route / Interrupt",
            " / ".join(fmt(shares.get(k), ".2%") for k in ("pull", "route", "interrupt")),
        ),
        (
            "rollout time in prefill / decode",
            " / ".join(fmt(shares.get(k), ".1%") for k in ("prefill", "decode")),
        ),
        ("run folder", str(run_dir)),
    ]
    for row in rows:
        if row is not None:
            table.add_row(*row)
    return table


def _evaluation_row(
    last: Mapping[str, Any] | None, best: Mapping[str, Any] | None
) -> tuple[str, str] | None:
    """The evaluation during training (eval.every), last and best: mean@k / pass@k."""
    if not last or not best:
        return None

    def one(e: Mapping[str, Any]) -> str:
        return f"{e['mean_at_k']:.3f} / {e['pass_at_k']:.3f} (step {e['step']})"

    label = f"held-out mean@{last['samples']} / pass@{last['k']}, last; best"
    return label, f"{one(last)}; {one(best)}"


# -- the waits before training ---------------------------------------------------------------


def phase_row(state: PhaseState) -> tuple[RenderableType, ...]:
    """label, bar, count, metrics, time: one row of the live progress grid."""
    bar: RenderableType
    if state.total:
        bar = ProgressBar(total=state.total, completed=min(state.done, state.total), width=28)
    else:
        bar = ProgressBar(total=None, pulse=True, width=28)
    metrics = "  ".join(
        [state.detail] * bool(state.detail) + [metric_text(k, v) for k, v in state.metrics.items()]
    )
    if state.goal:
        metrics = f"{metrics}  (stops at {state.goal})".strip()
    timing = f"{duration(state.elapsed_s)} elapsed"
    left = left_text(state)
    if left:
        timing += f", {left}"
    return (Text(state.label, style="bold"), bar, count_text(state), metrics, timing)


def phases_grid(states: list[PhaseState]) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(max_width=40, no_wrap=True, overflow="ellipsis")
    for _ in range(4):
        grid.add_column()
    for state in states:
        grid.add_row(*phase_row(state))
    return grid


class TerminalProgress:
    """A live bar for each running phase (and, under them, the run's live panel), and a
    line above them for each phase that ends. Use as a context manager around the run."""

    def __init__(self, console: Console, refresh_per_second: float = 4) -> None:
        self.console = console
        self._running: dict[tuple[str, float], PhaseState] = {}
        self._panel: RenderableType | None = None
        self._lock = threading.Lock()
        self._live = Live(
            console=console,
            get_renderable=self._renderable,
            refresh_per_second=refresh_per_second,
            transient=True,
        )

    def _renderable(self) -> RenderableType:
        with self._lock:
            states = list(self._running.values())
            panel = self._panel
        parts: list[RenderableType] = []
        if states:
            parts.append(phases_grid(states))
        if panel is not None:
            parts.append(panel)
        return Group(*parts)

    def set_panel(self, panel: RenderableType | None) -> None:
        """What shows under the bars (the buffers and instances while training)."""
        with self._lock:
            self._panel = panel

    # Renderer
    def started(self, state: PhaseState) -> None:
        with self._lock:
            self._running[state.key, state.started_s] = state
        if self._live.is_started:  # drawn now, not at the next refresh: a wait shorter
            self._live.refresh()  # than a refresh period (a quick first buffer) still shows

    def updated(self, state: PhaseState) -> None:
        with self._lock:
            if (state.key, state.started_s) in self._running:
                self._running[state.key, state.started_s] = state

    def finished(self, state: PhaseState) -> None:
        with self._lock:
            self._running.pop((state.key, state.started_s), None)
        style = "red" if state.failed else "dim"
        self.console.print(Text(progress_line(state), style=style))

    def __enter__(self) -> TerminalProgress:
        self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.stop()


class LaunchView:
    """What ``staleflow launch`` shows while it runs: in a terminal (and with ``live``),
    live bars and the buffers panel; otherwise plain progress lines every ``every_s``."""

    def __init__(self, console: Console, live: bool = True, every_s: float = 10.0) -> None:
        self.console = console
        if not console.is_terminal:
            console.soft_wrap = True  # a log gets whole lines, never broken at 80 columns
        self.terminal = TerminalProgress(console) if live and console.is_terminal else None
        renderer = self.terminal or PlainLines(console.file, every_s=every_s)
        self.progress = Progress(renderer, self)

    def on_tick(self, state: LiveState) -> None:
        """The control plane's live state, once training runs."""
        if self.terminal is not None:
            self.terminal.set_panel(live_panel(state))

    # Renderer: the buffers panel goes when training ends (the final scoring follows)
    def started(self, state: PhaseState) -> None:
        pass

    def updated(self, state: PhaseState) -> None:
        pass

    def finished(self, state: PhaseState) -> None:
        if state.key == "training" and self.terminal is not None:
            self.terminal.set_panel(None)

    def __enter__(self) -> LaunchView:
        if self.terminal is not None:
            self.terminal.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.terminal is not None:
            self.terminal.__exit__(*exc)
