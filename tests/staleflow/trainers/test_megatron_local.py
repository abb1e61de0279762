"""``run_local``: each child leaves its process group before the interpreter is torn down
(gloo can otherwise abort a finished process), and a child killed by a signal is named."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from staleflow.trainers.megatron.local import LocalRunError, run_local
from tests.staleflow.trainers.megatron_worker import abort, group_at_exit


def test_children_leave_their_group_before_exit(tmp_path):
    marker = tmp_path / "initialized-at-exit"
    assert run_local(2, group_at_exit, str(marker), timeout_s=240) == 2
    assert [(tmp_path / f"{marker.name}-{r}").read_text() for r in range(2)] == ["False"] * 2


def test_a_child_killed_by_a_signal_is_named():
    with pytest.raises(LocalRunError, match=r"rank 0 died by SIGABRT .*had not returned"):
        run_local(1, abort, None, timeout_s=240)
