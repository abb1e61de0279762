"""Code that runs in the worker actors: the Ray actor shells and their clients, the
rollout host of an instance, the reward stage, the trainer's loop, PS clients that
survive a restarted replica, weight transfer, the audit trail, and the specs each worker
builds its component from.

It may import :mod:`~staleflow.runtime.placement` (Ray's import and actor names), the
shared runtime modules, and the rest of ``staleflow`` below the runtime (engines,
trainers, rewards, models); never :mod:`~staleflow.runtime.controller` or
:mod:`~staleflow.runtime.driver`.
"""
