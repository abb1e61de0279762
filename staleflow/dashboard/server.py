"""Serving the dashboard with uvicorn: in a background thread (inside ``staleflow
launch``'s driver, or a test) or in the foreground (``staleflow dashboard``).

The socket is bound here, before uvicorn starts, so a port already in use is an
``OSError`` in the caller, with the fix in its message, rather than a log line from a
thread nobody watches.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp

logger = logging.getLogger(__name__)


class DashboardServer:
    """A running server; :meth:`stop` ends it (idempotent)."""

    def __init__(self, app: ASGIApp, sock: socket.socket) -> None:
        import uvicorn

        self.host, self.port = sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._sock = sock
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self, timeout_s: float = 10.0) -> DashboardServer:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="dashboard", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard did not start on {self.url}: see the log")
            time.sleep(0.02)
        return self

    def serve_forever(self) -> None:
        """Block until interrupted (Ctrl-C), in the calling (main) thread."""
        self._server.run(sockets=[self._sock])

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sock.close()


DEFAULT_PORT = 8266  # 8265 is Ray's own dashboard on a cluster's head node


def bind(host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port)."""
    if not 0 <= port <= 65535:  # socket.bind would raise OverflowError, not OSError
        raise OSError(
            f"the dashboard cannot listen on port {port}: use 1..65535, or 0 for any free port"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"the dashboard cannot listen on {host}:{port} ({exc.strerror}): pick another "
            "port (--port, or dashboard_port=... for staleflow launch)"
        ) from exc
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def bind_preferred(host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> socket.socket:
    """``port`` when it is free, else any free port (two runs on one machine each get a
    dashboard); the caller prints the URL it got."""
    try:
        return bind(host, port)
    except OSError as exc:
        logger.info("%s; using a free port instead", exc)
        return bind(host, 0)


def serve_in_thread(
    app: ASGIApp, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, fallback: bool = False
) -> DashboardServer:
    """Serve ``app`` from a daemon thread; ``fallback``: a free port if ``port`` is taken."""
    sock = bind_preferred(host, port) if fallback else bind(host, port)
    return DashboardServer(app, sock).start()
