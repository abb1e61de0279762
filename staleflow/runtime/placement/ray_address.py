"""Fail fast on a Ray cluster address that nothing answers at.

``ray.init(address="host:port")`` retries for minutes against an address where no cluster
runs; a user who mistyped it sees a hang. A TCP connect with a short timeout tells the
difference at once. ``auto`` and ``local`` (Ray's own discovery) are left to Ray.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``ray://host:port``; None for Ray's own words
    (``auto``, ``local``) and for addresses without a port."""
    if address in ("", "auto", "local"):
        return None
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"Ray address {address!r}: the port is not a number in 1..65535") from None
    if parts.hostname is None or port is None:
        return None
    return parts.hostname, port


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ``ConnectionError`` naming the address when nothing listens there."""
    target = host_port(address)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConnectionError(
            f"no Ray cluster answers at {address} ({exc}): start one there with "
            "`ray start --head`, or check the address (auto finds a local cluster)"
        ) from None
