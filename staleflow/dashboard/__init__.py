"""The REST dashboard of a run: a FastAPI app (``app.create_app``) over a ``RunSource``
(``interface``): a live Ray job (``ray_source``), a run folder (``folder_source``) or a
simulated cluster (``sim_source``), plus its single web page (``static/``) and
``staleflow status`` (``status``). See docs/dashboard.md.

Importing this package imports neither FastAPI nor Ray; ``app`` and ``server`` need
FastAPI and uvicorn (part of the default install; ``launch_hook`` imports them only when it
serves). The dashboard reads the runtime (its step records, live state and actor names);
the runtime never imports the dashboard.
"""

from staleflow.dashboard.interface import RunSource

__all__ = ["RunSource"]
