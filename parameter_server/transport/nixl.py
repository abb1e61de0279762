"""NIXL (UCX backend) transport, between processes or machines (paper App. A).

The worker registers its whole slot region with its NIXL agent once and ships
the agent metadata in its Welcome. A client agent loads that metadata once,
prepares one remote descriptor per slot once, and registers each destination
buffer the first time it sees it; a Pull is then one NIXL READ of the pinned
slot into the destination, a Push one WRITE from a registered staging buffer.

Agents are created with ``enable_prog_thread=False`` (an idle progress thread
spins a whole core; we poll while a transfer is in flight instead) and the UCX
backend with ``ucx_error_handling_mode='none'``: in peer mode UCX refuses its
shared-memory transports, which are the fast ones on one machine. That option
is a UCX backend init parameter, so the agent starts with no backend and
``create_backend('UCX', {...})`` adds it.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from parameter_server.errors import TransportError, TransportUnavailableError
from parameter_server.layout import Layout, Slice
from parameter_server.store import StoreInfo, Weights
from parameter_server.transport.base import (
    ControlClient,
    Endpoint,
    pack_for_push,
    validate_push,
)

logger = logging.getLogger(__name__)

UCX_INIT_PARAMS = {"ucx_error_handling_mode": "none"}
_MAX_REGISTERED = 8


def make_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend, or TransportUnavailableError naming why not."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, or a native library failing to load
        raise TransportUnavailableError(
            f"NIXL is not usable here ({type(exc).__name__}: {exc}); install it with "
            "`pip install nixl`, or use transport='shm' or 'socket'"
        ) from exc
    try:
        config = nixl_agent_config(enable_prog_thread=False, backends=[])
        agent = nixl_agent(name, config)
        if "UCX" not in agent.get_plugin_list():
            raise RuntimeError(f"no UCX plugin among {agent.get_plugin_list()}")
        agent.create_backend("UCX", dict(UCX_INIT_PARAMS))
    except Exception as exc:
        raise TransportUnavailableError(
            f"NIXL agent with the UCX backend failed to start ({type(exc).__name__}: {exc}); "
            "use transport='shm' or 'socket'"
        ) from exc
    return agent


def new_agent_name(role: str) -> str:
    return f"staleflow-{role}-{os.getpid()}-{secrets.token_hex(4)}"


class NixlRegion:
    """Worker side: one registration of the whole slot region, kept for the worker's life."""

    def __init__(self, array: np.ndarray) -> None:
        self.agent = make_agent(new_agent_name("ps"))
        self._array = array
        try:
            self._reg = self.agent.register_memory(
                [(int(array.ctypes.data), int(array.nbytes), 0, "")], "DRAM"
            )
        except Exception as exc:
            raise TransportUnavailableError(
                f"NIXL could not register the PS region: {exc}"
            ) from exc
        self.metadata: bytes = self.agent.get_agent_metadata()

    def close(self) -> None:
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as exc:  # the process is going away anyway
            logger.debug("NIXL deregistration failed: %s", exc)


class NixlTransport:
    """Pull/Push as one-sided NIXL READ/WRITE of a pinned slot."""

    name = "nixl"

    def __init__(self, endpoint: Endpoint) -> None:
        self._agent = make_agent(new_agent_name("client"))
        self._control = ControlClient(endpoint, f"nixl-{os.getpid()}")
        welcome = self._control.welcome
        self.layout: Layout = self._control.layout
        self.base_layout: Layout | None = self._control.base_layout
        if not welcome.nixl_metadata:
            self._control.close()
            raise TransportUnavailableError(
                "the PS worker was started without NIXL; start it with nixl=True "
                "or use transport='shm' or 'socket'"
            )
        self._stride = welcome.slot_stride
        self._region_addr = welcome.region_addr
        try:
            self._peer = self._agent.add_remote_agent(welcome.nixl_metadata)
            slots = [
                (welcome.region_addr + i * self._stride, self.layout.nbytes, 0)
                for i in range(welcome.num_slots)
            ]
            self._remote_slots = self._agent.prep_xfer_dlist(self._peer, slots, "DRAM")
        except Exception as exc:
            self._control.close()
            raise TransportUnavailableError(f"NIXL could not reach the PS worker: {exc}") from exc
        # (address, nbytes) -> (array kept alive, registration, prepared local list)
        self._local: OrderedDict[tuple[int, int], tuple[np.ndarray, Any, Any]] = OrderedDict()
        self._staging: np.ndarray | None = None
        # The agent runs in NIXL_THREAD_SYNC_NONE mode (no listener thread), so
        # callers sharing this transport across threads are serialised here.
        self._lock = threading.Lock()

    def pull(self, dest: np.ndarray, version: int | None = None) -> int:
        flat = self.layout.check_buffer(dest, "Pull destination")
        with self._lock:
            local = self._prepared(flat)
            lease = self._control.acquire_read(version)
            try:
                self._transfer("READ", local, lease.offset // self._stride)
            finally:
                self._control.release(lease.lease_id)
        return lease.version

    def pull_slices(
        self, dest: np.ndarray, slices: Sequence[Slice], version: int | None = None
    ) -> int:
        flat = self.layout.check_buffer(dest, "Pull destination")
        ranges = [(a, b) for a, b in self.layout.byte_ranges(slices) if b > a]
        with self._lock:
            self._prepared(flat)  # registers dest once; the descriptors below lie inside it
            lease = self._control.acquire_read(version)
            try:
                if ranges:
                    base = int(flat.ctypes.data)
                    remote = self._region_addr + lease.offset
                    local = [(base + a, b - a, 0) for a, b in ranges]
                    far = [(remote + a, b - a, 0) for a, b in ranges]
                    agent = self._agent
                    handle = agent.initialize_xfer(
                        "READ",
                        agent.get_xfer_descs(local, "DRAM"),
                        agent.get_xfer_descs(far, "DRAM"),
                        self._peer,
                    )
                    self._wait(handle, "READ")
            finally:
                self._control.release(lease.lease_id)
        return lease.version

    def push(self, weights: Weights, version: int | None = None) -> int:
        validate_push(self.layout, weights)
        with self._lock:
            if isinstance(weights, np.ndarray):
                source = weights.reshape(-1).view(np.uint8)
            else:
                if self._staging is None:
                    self._staging = np.zeros(self.layout.nbytes, dtype=np.uint8)
                pack_for_push(self.layout, weights, self._staging)
                source = self._staging
            local = self._prepared(source)
            lease = self._control.begin_push(version)
            try:
                self._transfer("WRITE", local, lease.offset // self._stride)
            except BaseException:
                self._control.abort_push(lease.lease_id)
                raise
            return self._control.commit_push(lease.lease_id)

    # The base of adapter versions moves once per client: over the control socket, with
    # no registration of its (large) region for that single transfer.
    def pull_base(self, dest: np.ndarray) -> None:
        self._control.stream_base_in(dest)

    def push_base(self, weights: Weights) -> None:
        self._control.stream_base_out(weights)

    def info(self) -> StoreInfo:
        return self._control.info()

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        for _, reg, prepped in self._local.values():
            self._release_local(reg, prepped)
        self._local.clear()
        try:
            self._remote_slots.release()
            self._agent.remove_remote_agent(self._peer)
        except Exception as exc:
            logger.debug("NIXL teardown: %s", exc)
        self._control.close()

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    def _prepared(self, flat: np.ndarray) -> Any:
        """Register ``flat`` the first time it is used; reuse the registration after."""
        key = (int(flat.ctypes.data), int(flat.nbytes))
        hit = self._local.get(key)
        if hit is not None:
            self._local.move_to_end(key)
            return hit[2]
        if len(self._local) >= _MAX_REGISTERED:
            _, (_, reg, prepped) = self._local.popitem(last=False)
            self._release_local(reg, prepped)
        try:
            reg = self._agent.register_memory([(key[0], key[1], 0, "")], "DRAM")
            prepped = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(key[0], key[1], 0)], "DRAM")
        except Exception as exc:
            raise TransportError(f"NIXL could not register a {key[1]}-byte buffer: {exc}") from exc
        self._local[key] = (flat, reg, prepped)
        return prepped

    def _release_local(self, reg: Any, prepped: Any) -> None:
        try:
            prepped.release()
            self._agent.deregister_memory(reg)
        except Exception as exc:
            logger.debug("NIXL deregistration failed: %s", exc)

    def _transfer(self, op: str, local: Any, slot: int) -> None:
        handle = self._agent.make_prepped_xfer(op, local, [0], self._remote_slots, [slot])
        self._wait(handle, op)

    def _wait(self, handle: Any, op: str) -> None:
        """Post ``handle`` and poll it to completion (no progress thread to do it for us)."""
        agent = self._agent
        try:
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportError(f"NIXL {op} failed (state {state})")
        finally:
            handle.release()
