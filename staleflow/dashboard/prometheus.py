"""``/metrics`` in the Prometheus text exposition format (version 0.0.4).

Written here rather than with ``prometheus_client``: every value is a gauge read from the
source at scrape time, so the client's registry, collectors and process metrics would add
a dependency and nothing we use. The format rules we rely on: one ``# HELP`` and
``# TYPE`` line per family before its samples, label values escaped (backslash, quote,
newline), ``NaN``/``+Inf`` spelled that way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from staleflow.dashboard.interface import LiveView, PSView, RunInfo
from staleflow.runfolder.step_record import StepRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_PREFIX = "staleflow_"
_BAD = re.compile(r"[^a-zA-Z0-9_]")

Sample = tuple[Mapping[str, str], float]


class Exposition:
    """Families in the order added; one family's samples stay together."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, list[Sample]]] = {}

    def gauge(self, name: str, help_: str, value: float | None, **labels: str) -> None:
        if value is None:
            return  # unknown is absent, not 0
        family = self._families.setdefault(metric_name(name), (help_, []))
        family[1].append((labels, float(value)))

    def render(self) -> str:
        lines: list[str] = []
        for name, (help_, samples) in self._families.items():
            lines.append(f"# HELP {name} {_escape_help(help_)}")
            lines.append(f"# TYPE {name} gauge")
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


def metric_name(key: str) -> str:
    """``throughput/tokens_per_s`` -> ``staleflow_throughput_tokens_per_s``."""
    name = _BAD.sub("_", key)
    return name if name.startswith(_PREFIX) else _PREFIX + name


def render(info: RunInfo, live: LiveView, ps: PSView, last_record: StepRecord | None) -> str:
    out = Exposition()
    out.gauge(
        "up", "1 while the run answers (0 once it finished or stopped)", 0 if live.finished else 1
    )
    out.gauge("steps", "training steps finished", live.steps)
    out.gauge("elapsed_seconds", f"run time ({info.clock} clock)", live.elapsed_s)
    out.gauge("ps_version", "latest version on the parameter server", ps.latest)
    out.gauge("coordinator_cycles", "coordinator snapshot cycles", live.cycles)
    out.gauge("coordinator_discarded", "snapshots rejected by Eq. 1", live.discarded)
    _buffers(out, live)
    _instances(out, info, live)
    if live.ts is not None:
        s = live.ts
        for state, n in (
            ("queued", s.queued),
            ("routed", s.routed),
            ("completed", s.completed),
            ("initial", s.initial),
        ):
            out.gauge("ts_trajectories", "trajectories in the TS by state", n, state=state)
        for state, by_v in (
            ("queued", s.queued_by_v),
            ("routed", s.routed_by_v),
            ("completed", s.completed_by_v),
        ):
            for v, n in sorted(by_v.items()):
                out.gauge(
                    "ts_trajectories_by_version",
                    "trajectories in the TS by state and V_traj",
                    n,
                    state=state,
                    v_traj=str(v),
                )
    if last_record is not None:
        _last_step(out, last_record)
    return out.render()


def _buffers(out: Exposition, live: LiveView) -> None:
    view = live.buffers
    if view is None:
        return
    out.gauge("trainer_version", "the buffer the trainer consumes next", view.version)
    out.gauge("eta", "staleness bound", view.eta)
    for b in view.buffers:
        v = str(b.version)
        out.gauge("buffer_capacity", "entry slots of a staleness buffer", b.capacity, buffer=v)
        out.gauge("buffer_occupied", "occupied entries of a staleness buffer", b.occupied, buffer=v)
        out.gauge("buffer_reserved", "reserved entries of a staleness buffer", b.reserved, buffer=v)
        for state in ("waiting", "ready", "stuck"):
            out.gauge(
                "buffer_state",
                "1 for the buffer's state (waiting, ready, stuck)",
                1 if b.state.value == state else 0,
                buffer=v,
                state=state,
            )


def _instances(out: Exposition, info: RunInfo, live: LiveView) -> None:
    for d in live.instances:
        i = str(d.inst)
        out.gauge("instance_version", "model version of a rollout instance", d.version, instance=i)
        out.gauge(
            "instance_measured_tokens_per_second",
            "decoded tokens per second, measured",
            d.measured_tokens_per_s,
            instance=i,
        )
        out.gauge(
            "instance_idle_ratio", "share of time with nothing to decode", d.idle_ratio, instance=i
        )
        s = d.snapshot
        if s is None:
            continue
        out.gauge("instance_running", "trajectories decoding", len(s.run_trajs), instance=i)
        out.gauge(
            "instance_waiting", "trajectories queued on the instance", len(s.wait_trajs), instance=i
        )
        out.gauge("instance_kv_cache_tokens", "KV-cache tokens in use", s.kv_cache, instance=i)
        if info.cost_model is not None:
            out.gauge(
                "instance_estimated_tokens_per_second",
                "the cost model's throughput for the snapshot (Eq. 2)",
                info.cost_model.throughput(len(s.run_trajs), s.kv_cache),
                instance=i,
            )


def _last_step(out: Exposition, rec: StepRecord) -> None:
    """The last step record: per-staleness, per-instance and per-kind items as labels."""
    for k, n in rec.staleness.items():
        out.gauge(
            "last_step_staleness_groups",
            "trajectories of the last step's batch by staleness",
            n,
            staleness=str(k),
        )
    for i, ratio in rec.instance_idle.items():
        out.gauge(
            "last_step_instance_idle_ratio",
            "share of its lifetime each rollout instance was idle, at the last step",
            ratio,
            instance=str(i),
        )
    for i, version in rec.instance_version.items():
        out.gauge(
            "last_step_instance_version",
            "model version of each rollout instance at the last step",
            version,
            instance=str(i),
        )
    for kind, share in rec.time_shares().items():
        out.gauge(
            "last_step_rollout_time_share", "share of rollout time (Table 3)", share, phase=kind
        )
    for kind, seconds in rec.command_latency_s.items():
        out.gauge(
            "last_step_coordinator_latency_seconds",
            "seconds the control plane spent on each command kind so far",
            seconds,
            command=kind,
        )
    for key, value in sorted(rec.scalars().items()):
        out.gauge(f"last_step_{key}", f"{key} of the last step", value)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{_BAD.sub("_", k)}="{_escape_label(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))
