"""SGLang as a rollout engine: an HTTP client of one ``sglang.launch_server`` per instance
(see docs/engines.md; importing this package imports neither sglang nor torch)."""

from __future__ import annotations

from pathlib import Path

from staleflow.engines.sglang.config import SGLangEngineConfig
from staleflow.engines.sglang.engine import ParameterServerSource, SGLangEngine
from staleflow.engines.sglang.http import SGLangError, SGLangHTTP
from staleflow.engines.sglang.launcher import ServerSpec, SGLangServer


def start_sglang_engine(
    spec: ServerSpec,
    config: SGLangEngineConfig,
    *,
    parameter_server: ParameterServerSource | None = None,
) -> SGLangEngine:
    """Start a server from ``spec`` and return an engine that owns it (stopped at close)."""
    server = SGLangServer(spec).start()

    def alive() -> str | None:
        code = server.exit_code()
        if code is None:
            return None
        return (
            f"the SGLang server (pid {server.pid}, {server.url}) exited with code {code}; its "
            f"log ({Path(spec.log_path)}) ends with:\n{server.log_tail()}"
        )

    return SGLangEngine(
        SGLangHTTP(server.url),
        config,
        parameter_server=parameter_server,
        server_alive=alive,
        on_close=server.stop,
    )


__all__ = [
    "ParameterServerSource",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangError",
    "SGLangHTTP",
    "SGLangServer",
    "ServerSpec",
    "start_sglang_engine",
]
