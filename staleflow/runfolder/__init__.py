"""The run folder of ``staleflow launch`` (``runs/<time>-<name>/``): the per-step record
and its flat form, the reader, the writer, and the run's state file.

Written by the driver (:mod:`staleflow.runtime.driver`), read by the dashboard,
``staleflow status``, the simulator's reports and the experiment scripts; so it stands
below both the runtime and the simulator, and imports neither (only the standard library,
:mod:`staleflow.config` and the pure core).
"""
