"""The dashboard of a run that ``staleflow launch`` is starting, served from the driver on
``127.0.0.1:<dashboard_port>`` (or a free port when that one is taken).

The runtime does not know the dashboard: ``staleflow launch`` hands a
:class:`LaunchDashboard` to :func:`staleflow.runtime.driver.launch.launch` as ``on_started``, and
forwards its phases to :meth:`LaunchDashboard.phase`, which the page shows. A dashboard
that cannot start is reported through ``say`` and the run goes on without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from staleflow.config import RunConfig
from staleflow.dashboard.ray_source import LaunchedRun, RaySource
from staleflow.dashboard.server import DashboardServer, serve_in_thread
from staleflow.install import missing


class ServedDashboard:
    """The server and the source it polls; :meth:`stop` ends both."""

    def __init__(self, server: DashboardServer, source: RaySource) -> None:
        self.server = server
        self.source = source

    @property
    def url(self) -> str:
        return str(self.server.url)

    def stop(self) -> None:
        self.server.stop()
        self.source.close()


def start_dashboard(cfg: RunConfig, run: LaunchedRun, host: str = "127.0.0.1") -> ServedDashboard:
    """Serve the dashboard of ``run`` (a :class:`staleflow.runtime.driver.launch.Run` whose actors
    are up). Raises ``ImportError`` without FastAPI or uvicorn and ``OSError``
    (naming the fix) when no port can be bound at all."""
    # FastAPI and uvicorn are an optional extra: without them the run starts and says so
    from staleflow.dashboard.app import create_app

    source = RaySource.from_run(run, cfg).start()
    try:
        server = serve_in_thread(create_app(source), host, cfg.dashboard_port, fallback=True)
    except BaseException:
        source.close()
        raise
    return ServedDashboard(server, source)


class LaunchDashboard:
    """``launch(cfg, on_started=LaunchDashboard(cfg, say))``: serves the dashboard once the
    actors are up; what the call returns (the server's stop) runs before they go away."""

    def __init__(self, cfg: RunConfig, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.say = say
        self.served: ServedDashboard | None = None
        self._phase: str | None = None
        self._lock = threading.Lock()

    def __call__(self, run: LaunchedRun) -> Callable[[], None] | None:
        try:
            served = start_dashboard(self.cfg, run)
        except ImportError as exc:
            self.say(f"dashboard off: {missing('the dashboard (fastapi, uvicorn)', exc)}")
            return None
        except OSError as exc:
            self.say(f"dashboard off: {exc}")
            return None
        with self._lock:
            self.served = served
            if self._phase is not None:
                served.source.set_phase(self._phase)
        self.say(f"dashboard at {served.url}")
        return served.stop

    def phase(self, text: str) -> None:
        """The launcher's current phase, shown on the page (kept until it is served)."""
        with self._lock:
            self._phase = text
            if self.served is not None:
                self.served.source.set_phase(text)
