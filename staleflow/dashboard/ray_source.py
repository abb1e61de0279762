"""A live ``staleflow launch`` job as a dashboard source, over the Ray actors of its run.

A poller thread asks the actors every ``poll_s`` (control plane: buffers, instance
snapshots, new step records; TS: counts; rollout actors: decode counters; PS: versions
held) and keeps the answers; requests are served from them, so a slow actor delays the
page's freshness, never a request. When the control actor goes away (the run ended or
crashed) the source keeps the last state and says so.

Attaching from another process finds the actors by name: ``staleflow launch`` names them
``<run folder name>/<role>`` in the Ray namespace :data:`ACTOR_NAMESPACE`.

Rollout instances come and go (a lost one is restarted, ``staleflow scale`` adds and
removes them, docs/recovery.md): each poll asks the control actor which are in the run,
and one that does not answer is left out of that poll. The run's recoveries are events
of kind ``recovery``; with the token, the actions ``add_instance`` and
``remove_instance`` ask the run for one rollout instance more or less.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coordinator.cost_model import CostModel
from parameter_server.transport import connect
from staleflow.config import RunConfig, config_to_dict
from staleflow.dashboard.interface import (
    ActionNotSupported,
    InstanceDetail,
    LiveView,
    LoadSample,
    Page,
    PSView,
    RunEvent,
    RunInfo,
)
from staleflow.dashboard.runconfig import cost_model_at, cost_model_of, read_run_config
from staleflow.dashboard.timeline import InstanceObservation, Recorder, SeqLog
from staleflow.runfolder.layout import RunLayout
from staleflow.runfolder.step_record import StepRecord, idle_ratio
from staleflow.runtime.controller.clients import ScalingControl
from staleflow.runtime.placement.ray_address import check_reachable
from staleflow.runtime.placement.ray_cluster import ACTOR_NAMESPACE, RayApi, actor_name

logger = logging.getLogger(__name__)

_PS_NOTE = (
    "the PS reports the versions it holds, its readers, whether a Push is running and the "
    "size of one version (what every Push and every whole Pull moves); push/pull times are "
    "when the dashboard saw the new version (within the poll period)"
)


ACTIONS = ("add_instance", "remove_instance")  # elastic rollout (docs/recovery.md)


class AttachError(RuntimeError):
    """No run could be attached; the message says how to name one."""


class LaunchedRun(Protocol):
    """What the dashboard reads of a started :class:`staleflow.runtime.driver.run.Run`
    (a protocol: the dashboard does not import the launcher)."""

    run_dir: Path

    @property
    def actors(self) -> Mapping[str, Any]: ...  # Any: Ray actor handles of several kinds


@dataclass(frozen=True, slots=True)
class RayHandles:
    control: Any
    ts: Any | None = None
    ps: Any | None = None
    instances: Mapping[int, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _State:
    live: Any = None  # staleflow.runtime.controller.plane_records.LiveState
    ts: Any = None
    times: dict[int, Any] = field(default_factory=dict)
    ps: Any = None  # parameter_server.store.StoreInfo
    finished: bool = False
    error: str = ""
    phase: str | None = None


class RaySource:
    def __init__(
        self,
        handles: RayHandles,
        *,
        name: str,
        config: Mapping[str, Any] | None = None,
        cost_model: CostModel | None = None,
        transport: str = "auto",
        poll_s: float = 1.0,
        timeout_s: float = 10.0,
        notes: tuple[str, ...] = (),
        placement: Mapping[str, Any] | None = None,
        ray: RayApi | None = None,  # the ray module; tests pass a fake
    ) -> None:
        if ray is None:
            import ray

        self._ray = ray
        self.handles = handles
        self._control = ScalingControl(handles.control, ray)
        self.name = name
        self._config = dict(config or {})
        self._cost = cost_model
        self._transport = transport
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._notes = notes
        self._placement = dict(placement or {})
        self._recorder = Recorder()
        self._records: SeqLog[StepRecord] = SeqLog(maxlen=1_000_000)
        self._state = _State()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ps_client: Any = None
        self._instances: dict[int, Any] = dict(handles.instances)  # the run's, as of the poll
        self._recovery_seen = 0
        self._thread = threading.Thread(target=self._serve, name="dashboard-poll", daemon=True)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_run(cls, run: LaunchedRun, cfg: RunConfig, **kwargs: float) -> RaySource:
        """Over the actors of a :class:`staleflow.runtime.driver.launch.Run` in this driver;
        ``kwargs``: ``poll_s``, ``timeout_s``."""

        a = run.actors
        handles = RayHandles(a["control"], a.get("ts"), a.get("ps"), dict(a.get("instances", {})))
        return cls(
            handles,
            name=run.run_dir.name,
            config=config_to_dict(cfg),
            cost_model=cost_model_of(cfg),
            transport=cfg.parameter_server.transport,
            placement=getattr(run, "placement_info", None),
            **kwargs,
        )

    @classmethod
    def attach(
        cls, address: str, run: str | None = None, run_dir: str | None = None, **kwargs: float
    ) -> RaySource:
        """Join the Ray cluster at ``address`` and find the named actors of ``run`` (the
        only run there when None). ``run_dir`` (default ``runs/<run>``) supplies the
        run's config, hence its cost model."""
        import ray

        if not ray.is_initialized():
            check_reachable(address)
            ray.init(
                address=address,
                namespace=ACTOR_NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == ACTOR_NAMESPACE
        ]
        runs = sorted({n.rsplit("/", 1)[0] for n in names if n.endswith("/control")})
        if run is None:
            if len(runs) != 1:
                found = ", ".join(runs) if runs else "none"
                raise AttachError(
                    f"{len(runs)} staleflow runs on the Ray cluster at {address} ({found}): "
                    "name one with --run <run folder name>"
                    if runs
                    else f"no staleflow run on the Ray cluster at {address}: start one with "
                    "staleflow launch, or check the address"
                )
            run = runs[0]
        elif run not in runs:
            raise AttachError(
                f"no run named {run!r} on the Ray cluster at {address}; running: "
                f"{', '.join(runs) or 'none'}"
            )

        def get(role: str) -> Any:
            try:
                return ray.get_actor(actor_name(run, role), namespace=ACTOR_NAMESPACE)
            except ValueError:
                return None

        prefix = actor_name(run, "instance/")
        instances = {
            int(n[len(prefix) :]): get(n[len(run) + 1 :])
            for n in names
            if n.startswith(prefix) and n[len(prefix) :].isdigit()
        }
        # the first PS replica (a run has one per rollout node: ps/0, ps/1, ...)
        ps = get("ps/0") or get("ps")
        handles = RayHandles(get("control"), get("ts"), ps, dict(sorted(instances.items())))
        try:
            placement = ScalingControl(handles.control, ray).placement(timeout_s=10)
        except Exception:  # a run of an older staleflow, or one that is ending
            placement = {}
        folder = Path(run_dir) if run_dir else Path("runs") / run
        config: dict[str, Any] = {}
        cost = None
        notes: tuple[str, ...] = ()
        if RunLayout(folder).config.exists():
            config, cost, note = read_run_config(folder)
            notes = (note,) if note else ()
        else:
            notes = (
                f"run config not found at {folder}/config.yaml: cost-model estimates are off; "
                "pass --run-dir <run folder>",
            )
        transport = str(config.get("parameter_server", {}).get("transport", "auto"))
        return cls(
            handles,
            name=run,
            config=config,
            cost_model=cost,
            transport=transport,
            notes=notes,
            placement=placement,
            **kwargs,
        )

    # -- polling --------------------------------------------------------------------------

    def start(self) -> RaySource:
        self.poll_once()  # the first page load has data
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.wait(self.poll_s):
            if not self.poll_once():
                return

    def poll_once(self) -> bool:
        """One round of questions; False once the run is gone for good."""
        ray, h = self._ray, self.handles
        try:
            live_reply = self._control.submit_live()
            records_reply = self._control.submit_records(len(self._records))
            ts_ref = h.ts.stats.remote() if h.ts is not None else None
            live = live_reply.result(self.timeout_s)
            records = records_reply.result(self.timeout_s)
            ts = ray.get(ts_ref, timeout=self.timeout_s) if ts_ref is not None else None
        except Exception as exc:  # which one decides whether to go on
            return self._failed(exc)
        self._follow_recoveries()
        times = self._times()
        ps = self._ps_info()
        self._records.extend(records)
        snaps = {s.inst: s for s in live.instances}
        self._recorder.observe(
            live.elapsed_s,
            [
                InstanceObservation(
                    i,
                    s.inst_version,
                    len(s.run_trajs),
                    len(s.wait_trajs),
                    s.kv_cache,
                    times[i].decode_tokens if i in times else None,
                )
                for i, s in sorted(snaps.items())
            ],
            ps_version=ps.latest if ps is not None else live.ps_version,
            steps=live.steps,
        )
        with self._lock:
            self._state = _State(live=live, ts=ts, times=times, ps=ps, phase=self._state.phase)
        return True

    def _follow_recoveries(self) -> None:
        """The instances in the run now, and the recovery events since the last poll
        (a run of a staleflow without them answers neither: nothing changes)."""
        try:
            members = self._control.members(timeout_s=self.timeout_s)
            events = self._control.events(self._recovery_seen, timeout_s=self.timeout_s)
        except Exception as exc:
            logger.debug("no membership or recovery events: %s", exc)
            return
        self._instances = {i: handle for i, (_, handle) in sorted(members.items())}
        self._recovery_seen += len(events)
        for e in events:
            _, _, tail = e.subject.partition("instance/")
            inst = int(tail) if tail.isdigit() else None
            detail = f"{e.kind.replace('_', ' ')} {e.subject}" + (
                f": {e.detail}" if e.detail else ""
            )
            self._recorder.events.append(RunEvent(e.time, "recovery", e.step, inst, detail))

    def _times(self) -> dict[int, Any]:
        """Each instance's counters; one that does not answer (lost, restarting) is left
        out of this poll."""
        ray = self._ray
        refs = {i: a.times.remote() for i, a in self._instances.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        done = {id(r) for r in ready}
        out = {}
        for i, ref in refs.items():
            if id(ref) not in done:
                continue
            try:
                out[i] = ray.get(ref)
            except Exception as exc:
                logger.debug("instance %d did not answer: %s", i, exc)
        return out

    def set_phase(self, text: str | None) -> None:
        """What the launcher is doing now (``LiveView.phase``); any thread."""
        with self._lock:
            self._state.phase = text

    def _failed(self, exc: BaseException) -> bool:
        errors = self._ray.exceptions
        gone = isinstance(exc, errors.RayActorError) or "ControlPlaneError" in repr(exc)
        text = str(exc).strip().splitlines()
        message = text[-1] if text else repr(exc)
        with self._lock:
            self._state.error = f"the run stopped answering: {message}"
            self._state.finished = gone
        if not isinstance(exc, errors.GetTimeoutError):
            logger.info("dashboard poll failed: %s", message)
        return not gone

    def _ps_info(self) -> Any:
        if self.handles.ps is None:
            return None
        try:
            if self._ps_client is None:
                endpoint = self._ray.get(self.handles.ps.endpoint.remote(), timeout=self.timeout_s)
                self._ps_client = connect(endpoint, self._transport)
            return self._ps_client.info()
        except Exception:
            logger.debug("PS info unavailable", exc_info=True)
            self._close_ps()
            return None

    def _close_ps(self) -> None:
        client, self._ps_client = self._ps_client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    # -- RunSource ------------------------------------------------------------------------

    def info(self) -> RunInfo:
        cfg = self._config
        rollout = cfg.get("rollout", {}) if isinstance(cfg.get("rollout"), dict) else {}
        live = self._snapshot().live
        view = live.buffers if live is not None else None
        return RunInfo(
            kind="live",
            name=self.name,
            clock="wall",
            eta=view.eta if view is not None else cfg.get("eta"),
            batch_size=view.batch_size if view is not None else cfg.get("batch_size"),
            group_size=view.group_size if view is not None else cfg.get("group_size"),
            instances=len(self._instances) or rollout.get("instances"),
            cost_model=cost_model_at(self._cost, self._records.last()),
            config=cfg,
            actions=ACTIONS,
            notes=self._notes,
            placement=self._placement,
        )

    def _snapshot(self) -> _State:
        with self._lock:
            return self._state

    def live(self) -> LiveView:
        st = self._snapshot()
        notes = [st.error] if st.error else []
        live = st.live
        if live is None:
            return LiveView(
                None, (), st.ts, None, 0, 0.0, st.finished, notes=tuple(notes), phase=st.phase
            )
        snaps = {s.inst: s for s in live.instances}
        ids = sorted(set(snaps) | set(self._instances))
        details = []
        for i in ids:
            t = st.times.get(i)
            snap = snaps.get(i)
            details.append(
                InstanceDetail(
                    inst=i,
                    version=snap.inst_version if snap is not None else None,
                    snapshot=snap,
                    measured_tokens_per_s=self._recorder.rates.get(i),
                    idle_ratio=idle_ratio(t.idle_s, t.busy_s) if t is not None else None,
                    pending_commands=live.pending.get(i, 0),
                    last_cycle_commands=None,
                    commands_total=dict(live.commands.get(i, {})),
                )
            )
        if live.last_discard:
            notes.append(f"last discarded snapshot: {live.last_discard}")
        return LiveView(
            buffers=live.buffers,
            instances=tuple(details),
            ts=st.ts,
            ps_version=live.ps_version,
            steps=live.steps,
            elapsed_s=live.elapsed_s,
            finished=st.finished,
            cycles=live.cycles,
            discarded=live.discarded,
            pending_commands=sum(live.pending.values()),
            notes=tuple(notes),
            phase=st.phase,
        )

    def records(self, since: int, limit: int) -> Page[StepRecord]:
        return self._records.page(since, limit)

    def load(self, since: int, limit: int) -> Page[LoadSample]:
        return self._recorder.load.page(since, limit)

    def events(self, since: int, limit: int) -> Page[RunEvent]:
        return self._recorder.events.page(since, limit)

    def ps(self) -> PSView:
        info = self._snapshot().ps
        notes = [_PS_NOTE]
        if info is None:
            notes.append("the PS did not answer: versions held and readers unknown")
        return PSView(
            latest=info.latest if info is not None else None,
            held=tuple(info.held) if info is not None else None,
            num_slots=info.num_slots if info is not None else None,
            readers=tuple(info.readers) if info is not None else None,
            pushing=info.pushing if info is not None else None,
            last_push_s=self._recorder.last_push,
            last_pull_s=dict(self._recorder.last_pull),
            version_bytes=info.version_bytes if info is not None else None,
            notes=tuple(notes),
        )

    def act(self, action: str) -> str:
        """Elastic rollout: one rollout instance more (``add_instance``) or less
        (``remove_instance``); the run carries it out at its next look."""
        if action not in ACTIONS:
            raise ActionNotSupported(f"a live run takes {list(ACTIONS)}, not {action!r}")
        if self._snapshot().finished:
            raise ActionNotSupported("the run has ended")
        control = self._control
        try:
            now = len(control.members(timeout_s=self.timeout_s))
            target = now + 1 if action == "add_instance" else now - 1
            if target < 1:
                raise ActionNotSupported(f"the run has {now} instance: it needs at least one")
            return control.request_scale(target, timeout_s=self.timeout_s)
        except ActionNotSupported:
            raise
        except Exception as exc:
            raise ActionNotSupported(f"the run did not take the request: {exc}") from exc

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout_s + self.poll_s)
        self._close_ps()
