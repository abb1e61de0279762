"""The runtime of a real run on Ray, grouped by the process that runs the code.

=====================================  =====================================================
package                                runs in
=====================================  =====================================================
:mod:`staleflow.runtime.driver`        the driver: ``staleflow launch`` (the run, its pools,
                                       the supervisor, resume, the terminal view) and
                                       ``staleflow scale``
:mod:`staleflow.runtime.controller`    the control actor: the control plane (staleness
                                       manager and coordinator on one loop), its rollout
                                       instances, fleet changes, tail races, step metrics
:mod:`staleflow.runtime.workers`       the worker actors: rollout host, reward stage,
                                       training loop, PS clients that heal
:mod:`staleflow.runtime.placement`     the driver, before anything starts: the placement
                                       plan, its fit to the nodes, the Ray cluster
=====================================  =====================================================

The run folder a run writes (step records, ``state.json``, the reader and the writer) is
:mod:`staleflow.runfolder`, below the runtime: the dashboard, ``staleflow status`` and
the simulator's reports read it too.

The modules here are shared by every process: :mod:`.interface` (the contracts between
the control actor and the workers), :mod:`.errors`, :mod:`.backends` (where a rollout or
trainer backend plugs in) and :mod:`.in_process` (wiring the components in one process).
Imports point down: ``driver`` -> ``controller`` -> ``workers`` -> ``placement`` -> these
shared modules and :mod:`staleflow.runfolder`; ``tests/test_imports.py`` checks that no
cycle forms.
"""
