"""The protocol's bounds on its configuration values, defined once.

Every layer that accepts these values (the run configuration, the trajectory server, the
staleness manager) checks them with :func:`redundancy_ok` and says :data:`REDUNDANCY_HINT`,
so a value one of them accepts is never refused by another later.
"""

from __future__ import annotations

# A redundancy ratio r runs floor(n * (1 + r)) members for n needed (paper §4.3, App. C):
# the paper uses r = 1/16; 16 would run 17x the work for the same batch, never useful.
MAX_REDUNDANCY = 16.0
REDUNDANCY_HINT = "use a ratio in [0, 16), e.g. 0.0625"


def redundancy_ok(value: object) -> bool:
    """Whether ``value`` is a usable batch or group redundancy ratio: ``0 <= r < 16``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0.0 <= value < MAX_REDUNDANCY
