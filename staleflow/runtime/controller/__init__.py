"""Code that runs in the control actor (one per run): the control plane, the shared
control loop (:mod:`staleflow.control`) on wall time, with the rollout instances it
drives, what happens when they leave or join, the tail races, and the per-step records.

It may import :mod:`~staleflow.runtime.workers` (the clients of the worker actors),
:mod:`~staleflow.runtime.placement` (Ray's import and actor names), the shared runtime
modules, :mod:`staleflow.runfolder` (the step record) and the pure core; never
:mod:`~staleflow.runtime.driver`.
"""
