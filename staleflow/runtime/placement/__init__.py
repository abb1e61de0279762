"""Placement, run by the driver before anything starts: the plan (pools, members, what
each asks for), its fit to a cluster's nodes, and the Ray cluster that reserves it as
placement groups (also where Ray is imported and actors are named, for every process).

The plan and the fit are pure; only :mod:`.ray_cluster` touches Ray. It may import the
shared runtime modules (:mod:`staleflow.runtime.errors`, :mod:`staleflow.runtime.backends`)
and :mod:`staleflow.config`; no other runtime package.
"""
