"""One call of untrusted code in a confined, forked process (Linux).

The sandbox's server (:mod:`staleflow.rewards.sandbox`) builds the function once, then
runs each call in a fresh process forked from it, confined as far as an unprivileged
process can confine itself on this kernel, and killed with everything it started when
the call's time is up. What is confined, in the order it is set up:

- **Process group**: the call runs in a session of its own; at the end of the call (an
  answer, a death or the limit) the whole group is killed with SIGKILL.
- **User**: a server running as root forks the call as ``nobody`` (root ignores
  RLIMIT_NPROC), unless ``nobody`` cannot read this Python's modules (an interpreter
  installed under /root): then the call stays root, in its namespaces.
- **Namespaces** (``unshare``, tried as one set and then smaller ones; each that fails is
  reported with its errno): a new user namespace (which makes the rest possible without
  root), a network namespace with nothing in it (no interface but a loopback that is
  down: every ``connect`` fails, 127.0.0.1 included), a PID namespace (the call is its
  process 1, so when it dies the kernel kills every process it left, even one that left
  its process group), a mount namespace in which every mount is read-only except a
  private tmpfs of ``file_mb`` at the working directory.
- **A working directory** made empty for the call and removed after it (the tmpfs above,
  or a plain directory where mount namespaces are not allowed), also ``HOME`` and
  ``TMPDIR``.
- **The environment**: emptied but for ``PATH``, ``HOME``, ``TMPDIR`` and ``LANG``, and
  the process's original environment block (``/proc/self/environ``) overwritten.
- **File descriptors**: all closed but the answer's pipe; stdin, stdout and stderr are
  /dev/null.
- **Resource limits**: CPU seconds, address space (``memory_mb`` above what the forked
  process holds at the start), file size, open files, core dumps off, and processes
  (RLIMIT_NPROC, counted per user namespace, so only with one and not as root).
- **Privileges**: no capabilities (dropped after the mounts), ``no_new_privs``.

What is **not** confined: without a mount namespace the call can read and write every
file its user can (only the working directory is fresh); reading is never confined
(``/proc``, the code, the data); the call can read the memory it was forked with, so
secrets the server read before the fork (its environment at start-up, for instance) are
within reach; without a user namespace a call that is not root can signal or trace the
worker's other processes; there is no seccomp filter and no limit on CPU share or disk
bandwidth. ``probe`` reports, with reasons, what this machine allows.

The answer travels back as msgpack of plain data, never pickled: unpickling what a
confined process wrote would run its code outside the confinement.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pwd
import resource
import select
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import msgpack

from staleflow.rewards.base import RewardError

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# tried in this order: each later set is what remains possible when the one before fails
_NAMESPACE_SETS = (
    ("user, network, PID, mount", CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS),
    ("user, network, PID", CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID),
    ("user, network", CLONE_NEWUSER | CLONE_NEWNET),
    ("network", CLONE_NEWNET),  # root without user namespaces
)
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_MOUNT_ATTR_RDONLY, _AT_RECURSIVE, _AT_FDCWD = 0x1, 0x8000, -100
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture that has it
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_CAP_VERSION_3 = 0x20080522
_MAX_REPLY = 64 << 20  # bytes; a larger answer is refused, not read into memory
_KEPT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What one call may use. ``cpu_s`` is CPU seconds (the wall-clock limit is the
    caller's); ``memory_mb`` is address space above what the forked process holds."""

    cpu_s: float = 60.0
    memory_mb: int = 1024
    file_mb: int = 64  # the largest file, and the working directory's tmpfs
    processes: int = 32
    open_files: int = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """How a call ended: ``ok`` (``value`` is its plain-data answer), ``error`` (it
    raised: ``value`` says what), ``memory`` (it ran out of its address space),
    ``timeout`` (killed at the limit) or ``died`` (the process ended without answering).
    ``notes`` says which confinement held, and why any did not."""

    status: str
    value: Any
    notes: tuple[str, ...] = ()


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _send(fd: int, reply: list[Any]) -> None:
    try:
        body = msgpack.packb(reply, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        body = msgpack.packb(["error", f"the answer is not plain data: {exc}", reply[2]])
    data = len(body).to_bytes(4, "big") + body
    while data:
        data = data[os.write(fd, data) :]


def _close_fds_but(keep: int) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, keep)
    os.closerange(keep + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return 65534, 65534
    return entry.pw_uid, entry.pw_gid


def _others_can_import() -> bool:
    """Whether a user other than the owner can read the interpreter and every module
    folder (a Python installed under /root cannot: nobody's imports would fail)."""
    folders = {os.path.realpath(p) for p in (*sys.path, os.path.dirname(os.__file__)) if p}
    for folder in filter(os.path.isdir, folders):
        if os.stat(folder).st_mode & 0o005 != 0o005:
            return False
        parent = os.path.dirname(folder)
        while parent != os.path.dirname(parent):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(parent)
    return True


def _drop_root(notes: list[str]) -> None:
    if os.geteuid() != 0:
        return
    if not _OTHERS_CAN_IMPORT:
        notes.append(
            "not confined: the user (root, kept: nobody cannot read this Python's modules)"
        )
        return
    uid, gid = _nobody()
    try:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        notes.append(f"user: root dropped to uid {uid}")
    except OSError as exc:
        notes.append(f"not confined: the user (still root: {exc}): root may write any file")


def _unshare(flags: int) -> None:
    libc, uid, gid = _libc(), os.geteuid(), os.getegid()
    if flags == 0:
        return
    _check(libc.unshare(flags), "unshare")
    if flags & CLONE_NEWUSER:  # map the user to itself, so that the tmpfs it mounts is its own
        # a process whose user changed is not dumpable: its /proc/self files are root's
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # again: no other process of this user traces it


def _read_only_but(scratch: str, limits: Limits, notes: list[str]) -> None:
    libc = _libc()
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, b"/", _AT_RECURSIVE, attr, ctypes.sizeof(attr)),
        "mount_setattr(/, read-only, recursive)",
    )
    options = f"size={limits.file_mb}m,mode=0700".encode()
    _check(libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", 0, options), "mount tmpfs")
    notes.append(f"files: read-only but a {limits.file_mb} MiB tmpfs working directory")


def _scrub_environment(scratch: str) -> None:
    start, end = _environ_block()
    os.environ.clear()  # unsetenv each: libc's environ no longer points into the block
    os.environ.update(_KEPT_ENV, HOME=scratch, TMPDIR=scratch)
    tempfile.tempdir = scratch
    if end > start:  # what /proc/self/environ shows: the block the process was exec'd with
        ctypes.memset(start, 0, end - start)


def _environ_block() -> tuple[int, int]:
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51
    except (OSError, IndexError, ValueError):
        return 0, 0


def _lower(kind: int, soft: int, hard: int) -> None:
    """Set a limit, never above the one inherited (only root may raise a hard limit)."""
    inherited = resource.getrlimit(kind)[1]
    if inherited != resource.RLIM_INFINITY:
        hard = min(hard, inherited)
    resource.setrlimit(kind, (min(soft, hard), hard))


def _set_limits(limits: Limits, counted_per_namespace: bool, notes: list[str]) -> None:
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cpu = max(1, int(limits.cpu_s + 0.999))
    for kind, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU, then SIGKILL a second later
        (resource.RLIMIT_AS, (held + (limits.memory_mb << 20),) * 2),
        (resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2),
        (resource.RLIMIT_NOFILE, (limits.open_files,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        _lower(kind, *value)
    if counted_per_namespace and os.geteuid() != 0:
        _lower(resource.RLIMIT_NPROC, limits.processes, limits.processes)
        notes.append(f"processes: at most {limits.processes}")
    else:
        notes.append(
            "not confined: the number of processes (RLIMIT_NPROC counts every process of "
            "the user outside a user namespace, and never binds root)"
        )


def _drop_privileges(notes: list[str]) -> None:
    libc = _libc()
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable for 2 words: none
    _check(libc.capset(header, data), "capset(none)")
    notes.append("privileges: no capabilities, no_new_privs")


def _run_call(
    fn: Callable[..., Any], request: Sequence[Any], limits: Limits, scratch: str, fd: int
) -> NoReturn:
    """Process 1 of the namespaces (or the warden's child): confine, call, answer."""
    notes: list[str] = list(_NOTES)
    try:
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if _FLAGS & CLONE_NEWNS:
            _read_only_but(scratch, limits, notes)
        else:
            notes.append(
                "not confined: files (no mount namespace): the user's, but for a fresh "
                "working directory"
            )
        os.chdir(scratch)
        _scrub_environment(scratch)
        _set_limits(limits, bool(_FLAGS & CLONE_NEWUSER), notes)
        if _FLAGS & CLONE_NEWUSER:
            _drop_privileges(notes)
    except (OSError, ValueError) as exc:  # a step that failed cannot be skipped: it would
        # confine less than the namespaces chosen promise
        _send(fd, ["error", f"the sandbox could not be set up: {exc}", notes])
        os._exit(0)
    try:
        reply = ["ok", fn(*request), notes]
    except MemoryError:
        reply = ["memory", "", notes]
    except BaseException as exc:  # SystemExit too: this process answers, then exits
        reply = ["error", str(exc) if isinstance(exc, RewardError) else repr(exc), notes]
    _send(fd, reply)
    os._exit(0)


_OTHERS_CAN_IMPORT: bool | None = None  # decided once, before the first fork
_NOTES: list[str] = []  # what the warden set up, read by its forked child
_FLAGS = 0  # the namespaces it made


def _warden(
    fn: Callable[..., Any],
    request: Sequence[Any],
    limits: Limits,
    scratch: str,
    fd: int,
    namespaces: int,
) -> NoReturn:
    """The forked call process: a session of its own, namespaces, then (in a PID
    namespace its first process must be a child) the call in a child; reports a death."""
    global _FLAGS
    try:
        _close_fds_but(fd)
        os.setsid()
        if namespaces & CLONE_NEWUSER:  # as nobody, so that the namespace counts nobody's
            _drop_root(_NOTES)
            _unshare(namespaces)
        else:  # a network namespace without a user one needs root
            _unshare(namespaces)
            _drop_root(_NOTES)
        _FLAGS = namespaces
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # creds changed: set now
        child = os.fork()
        if child == 0:
            _run_call(fn, request, limits, scratch, fd)
        _, status = os.waitpid(child, 0)
        _send(fd, ["died", _how_it_ended(status), _NOTES])
    except BaseException as exc:
        _send(fd, ["error", f"the sandbox could not be set up: {exc!r}", _NOTES])
    os._exit(0)


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = {signal.SIGKILL: " (CPU seconds or a kill)", signal.SIGXCPU: " (CPU seconds)"}
        return f"killed by {signal.Signals(sig).name}{why.get(sig, '')}"
    return f"exited with code {os.WEXITSTATUS(status)} without answering"


def _read_reply(fd: int, deadline: float) -> bytes | None:
    """The first length-prefixed message on ``fd``; None past ``deadline``; b"" when the
    pipe closed without one."""
    buf = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        buf += chunk
        if len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big")
            if size > _MAX_REPLY:
                return b""
            if len(buf) >= 4 + size:
                return bytes(buf[4 : 4 + size])


def _unpack(data: bytes) -> Reply:
    try:
        status, value, notes = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return Reply(str(status), value, tuple(str(n) for n in notes))
    except (ValueError, TypeError, msgpack.UnpackException):
        return Reply("died", "its answer was malformed")


def call_confined(
    fn: Callable[..., Any],
    request: Sequence[Any],
    limits: Limits,
    timeout_s: float,
    namespaces: int | None = None,
) -> Reply:
    """``fn(*request)`` in a confined, forked process, waited for at most ``timeout_s``
    (0: no limit), in the ``namespaces`` given (``CLONE_NEW*`` flags; None: the ones
    :func:`choose_namespaces` finds). ``fn`` must return plain data. Call it from a
    single-threaded process: it forks."""
    global _OTHERS_CAN_IMPORT
    if _OTHERS_CAN_IMPORT is None:
        _OTHERS_CAN_IMPORT = _others_can_import()
    if namespaces is None:
        namespaces = choose_namespaces(limits)[0]
    scratch = tempfile.mkdtemp(prefix="staleflow-sandbox-")
    if os.geteuid() == 0 and _OTHERS_CAN_IMPORT:  # it runs as nobody: the directory is its own
        os.chown(scratch, *_nobody())
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            _warden(fn, request, limits, scratch, write_end, namespaces)
        os.close(write_end)
        deadline = time.monotonic() + (timeout_s if timeout_s > 0 else 1e9)
        data = _read_reply(read_end, deadline)
        # whatever is left of the call: its group, and (with the warden) its namespace
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    finally:
        os.close(read_end)
        shutil.rmtree(scratch, ignore_errors=True)
    if data is None:
        return Reply("timeout", f"timed out after {timeout_s:g}s")
    if not data:
        return Reply("died", "the call's process ended without answering")
    return _unpack(data)


_CHOSEN: dict[Limits, tuple[int, tuple[str, ...]]] = {}


def choose_namespaces(limits: Limits) -> tuple[int, tuple[str, ...]]:
    """The largest set of namespaces in which a call that does nothing runs on this
    machine, and the notes of that call: which confinement holds, and why the larger sets
    did not (unshare refused, or a step after it: a kernel that lets a process make a
    user namespace may still refuse it the mounts). Decided once per process."""
    if limits in _CHOSEN:
        return _CHOSEN[limits]
    refused: list[str] = []
    for name, flags in (*_NAMESPACE_SETS, ("none", 0)):
        reply = call_confined(_nothing, (), limits, 30.0, namespaces=flags)
        if reply.status == "ok":
            break
        refused.append(f"{name}: {reply.value}")
    if flags == 0:
        notes = ("not confined: the network (no namespace: " + "; ".join(refused) + ")",)
    else:
        notes = (f"namespaces: {name}" + (f" (refused: {'; '.join(refused)})" if refused else ""),)
    _CHOSEN[limits] = flags, notes + reply.notes
    return _CHOSEN[limits]


def _nothing() -> None:
    return None


def probe(limits: Limits | None = None) -> tuple[str, ...]:
    """What confinement a call gets on this machine, with the reason for what it does
    not."""
    return choose_namespaces(limits or Limits())[1]
