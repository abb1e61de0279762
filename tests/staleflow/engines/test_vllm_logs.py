"""vLLM's own log routed to a file at warning level (``staleflow/engines/vllm/logs.py``).

Plain ``logging``: runs without vLLM. That vLLM applies the same config in its own
processes, and that a launch's console stays free of it, is checked on real vLLM in
``test_launch_vllm.py``.
"""

from __future__ import annotations

import json
import logging
import logging.config
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from staleflow.engines.vllm.logs import LOGGER, logging_dict, route_vllm_logs, warnings_to_log


@pytest.fixture
def vllm_logger() -> Iterator[logging.Logger]:
    log = logging.getLogger(LOGGER)
    saved = (list(log.handlers), log.level, log.propagate)
    yield log
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    for h in saved[0]:
        log.addHandler(h)
    log.setLevel(saved[1])
    log.propagate = saved[2]


def test_vllm_warnings_go_to_the_file_and_nothing_else_does(tmp_path, vllm_logger, capsys):
    path = tmp_path / "vllm" / "instance-0.log"
    config_file = route_vllm_logs(str(path))
    child = logging.getLogger(f"{LOGGER}.model_executor.model_loader.reload.layerwise")
    child.info("Reloading weights inplace...")
    child.warning("RotaryEmbedding: Failed to load weights")
    logging.getLogger("staleflow.other").warning("not vLLM's")
    for h in vllm_logger.handlers:
        h.flush()
    text = path.read_text(encoding="utf-8")
    assert "WARNING" in text and "RotaryEmbedding: Failed to load weights" in text
    assert "Reloading weights inplace" not in text and "not vLLM's" not in text
    assert "Failed to load weights" not in "".join(capsys.readouterr())
    # the file vLLM applies in each of its processes says the same
    saved = json.loads(Path(config_file).read_text(encoding="utf-8"))
    assert saved == logging_dict(str(path))


def test_the_dict_config_vllm_applies_routes_to_the_same_file(tmp_path, vllm_logger):
    path = tmp_path / "vllm.log"
    logging.config.dictConfig(logging_dict(str(path)))  # what vLLM does with the file
    logging.getLogger(f"{LOGGER}.engine").info("started")
    logging.getLogger(f"{LOGGER}.engine").error("failed")
    for h in vllm_logger.handlers:
        h.flush()
    text = path.read_text(encoding="utf-8")
    assert "failed" in text and "started" not in text
    assert not vllm_logger.propagate


def test_python_warnings_raised_while_vllm_starts_are_logged(tmp_path, vllm_logger, capsys):
    path = tmp_path / "vllm.log"
    route_vllm_logs(str(path))
    with pytest.raises(RuntimeError), warnings_to_log():
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)
        raise RuntimeError("the start failed")  # what was caught is logged all the same
    for h in vllm_logger.handlers:
        h.flush()
    assert "FutureWarning: `torch.distributed.reduce_op`" in path.read_text(encoding="utf-8")
    assert "reduce_op" not in "".join(capsys.readouterr())
