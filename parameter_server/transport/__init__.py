"""Transports between a PS worker and its clients, chosen by name.

``connect(endpoint, "auto")`` picks shared memory on the worker's own host,
else NIXL, else a plain socket. Asking for NIXL where it cannot start falls
back (shared memory on the same host, else socket) with one warning per
process instead of failing: a slower Pull beats a dead rollout instance.
"""

from __future__ import annotations

import importlib
import logging

from parameter_server.errors import TransportUnavailableError
from parameter_server.transport.base import Endpoint, Transport

logger = logging.getLogger(__name__)

# Lazy: importing this package must not import nixl.
_REGISTRY: dict[str, str] = {
    "shm": "parameter_server.transport.shm:ShmTransport",
    "nixl": "parameter_server.transport.nixl:NixlTransport",
    "socket": "parameter_server.transport.socket:SocketTransport",
}
TRANSPORT_NAMES: tuple[str, ...] = ("auto", *_REGISTRY)

_warned_nixl = False


def transport_class(name: str) -> type:
    try:
        module, _, attr = _REGISTRY[name].partition(":")
    except KeyError:
        raise ValueError(
            f"unknown transport {name!r}; choose one of {', '.join(TRANSPORT_NAMES)}"
        ) from None
    return getattr(importlib.import_module(module), attr)


def connect(endpoint: Endpoint, transport: str = "auto") -> Transport:
    """Open a client of the worker at ``endpoint`` over ``transport``.

    ``auto`` tries shared memory (same host only), then NIXL, then the socket.
    An explicit ``nixl`` that cannot start falls back the same way; an explicit
    ``shm`` or ``socket`` that cannot start raises.
    """
    if transport not in TRANSPORT_NAMES:
        raise ValueError(
            f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORT_NAMES)}"
        )
    if transport in ("shm", "socket"):
        return transport_class(transport)(endpoint)
    same_host = endpoint.same_host() and bool(endpoint.region_name)
    order = ["nixl", "socket"]
    if transport == "auto" and same_host:
        order.insert(0, "shm")
    elif same_host:
        order.insert(1, "shm")
    for name in order[:-1]:
        try:
            return transport_class(name)(endpoint)
        except TransportUnavailableError as exc:
            if name == "nixl":
                _warn_nixl_once(exc)
            else:
                logger.info("transport %s unavailable (%s); trying the next one", name, exc)
    return transport_class(order[-1])(endpoint)


def _warn_nixl_once(exc: Exception) -> None:
    global _warned_nixl
    if not _warned_nixl:
        _warned_nixl = True
        logger.warning("NIXL transport unavailable (%s); falling back to shm or socket", exc)


__all__ = ["TRANSPORT_NAMES", "Endpoint", "Transport", "connect", "transport_class"]
