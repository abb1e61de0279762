"""Names of a run's Ray actors: ``<run folder name>/<role>`` in the namespace
:data:`ACTOR_NAMESPACE`, so that another process (``staleflow dashboard --address``,
``staleflow status --address``) finds the run that ``staleflow launch`` started."""

from __future__ import annotations

ACTOR_NAMESPACE = "staleflow"
CONTROL, TS, PS, TRAINER = "control", "ts", "ps", "trainer"
INSTANCE_PREFIX = "instance/"


def actor_name(run: str, role: str) -> str:
    """The Ray name of one actor of run ``run`` (the run folder's name)."""
    return f"{run}/{role}"


def instance_role(inst: int) -> str:
    return f"{INSTANCE_PREFIX}{inst}"
