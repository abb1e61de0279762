"""The REST dashboard of a run: a FastAPI app (``app.create_app``) over a ``RunSource``
(``interface``): a live Ray job (``ray_source``), a run folder (``folder_source``) or a
simulated cluster (``sim_source``), plus its single web page (``static/``) and the
operator's terminal tools (``status``, ``profiling``). See docs/dashboard.md.

Importing this package imports neither FastAPI nor Ray; ``app``, ``server`` and
``launch_hook`` need FastAPI and uvicorn (part of the default install).
"""

from staleflow.dashboard.interface import RunSource

__all__ = ["RunSource"]
