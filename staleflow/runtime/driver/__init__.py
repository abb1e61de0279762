"""Code that runs in the driver process: ``staleflow launch`` (the launch and the run it
starts pool by pool, the supervisor that restarts what died, resume, graceful stop,
held-out evaluation, the progress and terminal view) and ``staleflow scale``.

The top of the runtime: it may import every other runtime package
(:mod:`~staleflow.runtime.controller` and :mod:`~staleflow.runtime.workers` for the actor
classes its pools start, :mod:`~staleflow.runtime.placement`,
:mod:`staleflow.runfolder`); nothing in the runtime imports it. The CLI and the
dashboard's launch hook do.
"""
