"""The protocol's bounds on its configuration values, defined once.

Every layer that accepts these values (the run configuration, the trajectory server, the
staleness manager) checks them with :func:`config_problem` (and :func:`redundancy_ok`), so
a value one of them accepts is never refused by another later, and an absurd one is
refused where it is typed, before anything starts.

Where each limit comes from (measured on the 2-core development machine):

- ``eta``: the manager keeps rings of ``eta + 1`` buffers, and every Reserve/Occupy
  repacks and every ``view()`` (the coordinator's and the dashboard's, each cycle) draws
  all of them: O(eta) each, about 10 us per buffer (a reserve + complete took 10 ms at
  eta=1024, 114 ms at 16384; a view 37 ms and 308 ms). At 1024 one trajectory already
  costs the control plane milliseconds; above it the protocol cannot keep up with the
  rollout. No run needs an eta above its step count either (nothing is older than it).
- trajectories held: the trajectory server samples ``(eta + 1)`` buffers of
  ``floor(batch_size * (1 + r_b))`` groups of ``floor(G * (1 + r_g))`` trajectories before
  the first step and holds that many at once: about 460 bytes and 90 us each for a
  64-token prompt (262,144 took 120 MB and 23 s to sample), so 2**20 is about 0.5 GB and
  a minute and a half of start-up before any rollout.
"""

from __future__ import annotations

# A redundancy ratio r runs floor(n * (1 + r)) members for n needed (paper §4.3, App. C):
# the paper uses r = 1/16; 16 would run 17x the work for the same batch, never useful.
MAX_REDUNDANCY = 16.0
REDUNDANCY_HINT = "use a ratio in [0, 16), e.g. 0.0625"

MAX_ETA = 1024
ETA_WHY = (
    "the staleness manager's Reserve, Occupy and view cost O(eta), about 10 ms a "
    "trajectory at eta=1024; no run needs eta above its steps"
)
MAX_HELD_TRAJECTORIES = 2**20
HELD_WHY = (
    "the trajectory server samples (eta + 1) x batch_size x group_size trajectories (with "
    "redundancy) before the first step and holds them at once: 2**20 is about 0.5 GB and "
    "a minute and a half of sampling"
)


def redundancy_ok(value: object) -> bool:
    """Whether ``value`` is a usable batch or group redundancy ratio: ``0 <= r < 16``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0.0 <= value < MAX_REDUNDANCY


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is not a count


def held_trajectories(
    eta: int, batch_size: int, group_size: int, batch_redundancy: float, group_redundancy: float
) -> int:
    """Trajectories the trajectory server holds at once: one group per buffer entry."""
    entries = int(batch_size * (1.0 + batch_redundancy) + 1e-9)
    per_group = int(group_size * (1.0 + group_redundancy) + 1e-9)
    return (eta + 1) * entries * per_group


def config_problem(
    eta: object,
    batch_size: object,
    group_size: object,
    batch_redundancy: object = 0.0,
    group_redundancy: object = 0.0,
) -> str | None:
    """What is wrong with these protocol settings, as ``"<key>=<value> ...: <fix>"``, or
    None when the protocol can hold them."""
    if not _is_int(eta):
        return f"eta={eta!r} is not an integer: use 0 for synchronous RL, e.g. 3"
    if eta < 0:  # type: ignore[operator]
        return f"eta={eta!r} is negative: use 0 for synchronous RL, e.g. 3"
    if eta > MAX_ETA:  # type: ignore[operator]
        return f"eta={eta!r} is too large: use at most {MAX_ETA} ({ETA_WHY})"
    for key, value, unit in (
        ("batch_size", batch_size, "group per step"),
        ("group_size", group_size, "trajectory per group"),
    ):
        if not _is_int(value):
            return f"{key}={value!r} is not an integer: use at least 1 {unit}"
        if value < 1:  # type: ignore[operator]
            return f"{key}={value!r} is too small: use at least 1 {unit}"
        if value > MAX_HELD_TRAJECTORIES:  # type: ignore[operator]
            return f"{key}={value!r} is too large: use at most {MAX_HELD_TRAJECTORIES} ({HELD_WHY})"
    for key, value in (
        ("batch_redundancy", batch_redundancy),
        ("group_redundancy", group_redundancy),
    ):
        if not redundancy_ok(value):
            return f"{key}={value!r} is out of range: {REDUNDANCY_HINT}"
    held = held_trajectories(eta, batch_size, group_size, batch_redundancy, group_redundancy)  # type: ignore[arg-type]
    if held > MAX_HELD_TRAJECTORIES:
        return (
            f"eta={eta}, batch_size={batch_size}, group_size={group_size} hold {held} "
            f"trajectories at once, more than {MAX_HELD_TRAJECTORIES} ({HELD_WHY}): lower "
            "eta, batch_size or group_size (or the redundancies)"
        )
    return None
