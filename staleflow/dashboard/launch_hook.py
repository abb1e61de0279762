"""What ``staleflow launch`` calls with ``dashboard=true`` (the default): the dashboard of
the run being launched, served from the driver on ``127.0.0.1:<dashboard_port>``, or on a
free port when that one is taken."""

from __future__ import annotations

from typing import Any

from staleflow.dashboard.app import create_app
from staleflow.dashboard.ray_source import RaySource
from staleflow.dashboard.server import DashboardServer, serve_in_thread


class ServedDashboard:
    """The server and the source it polls; :meth:`stop` ends both."""

    def __init__(self, server: DashboardServer, source: RaySource) -> None:
        self.server = server
        self.source = source

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.source.close()


def start_dashboard(cfg: Any, run: Any, host: str = "127.0.0.1") -> ServedDashboard:
    """Raises ``OSError`` (naming the fix) when no port can be bound at all."""
    source = RaySource.from_run(run, cfg).start()
    try:
        server = serve_in_thread(create_app(source), host, cfg.dashboard_port, fallback=True)
    except BaseException:
        source.close()
        raise
    return ServedDashboard(server, source)
