"""Code that runs in the control actor (one per run): the control plane, the shared
control loop (:mod:`staleflow.control`) on wall time, with the rollout instances it
drives, what happens when they leave or join, the tail races, and the per-step records.
Its clients (:mod:`.clients`) run in the driver and the dashboard instead: they speak the
actor's methods and records, and every call to the actor goes through one of them.

It may import :mod:`~staleflow.runtime.workers` (the clients of the worker actors),
:mod:`~staleflow.runtime.placement` (Ray's import and actor names), the shared runtime
modules, :mod:`staleflow.runfolder` (the step record) and the pure core; never
:mod:`~staleflow.runtime.driver`.
"""
