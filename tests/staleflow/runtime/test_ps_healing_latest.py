"""``HealingPull.latest_version``: what an instance whose engine pulls the weights itself
(SGLang's TP ranks) asks its replica for. The first real-SGLang launch (CI's SGLang stage)
died at start-up because the healing source lacked it."""

from __future__ import annotations

import numpy as np
import pytest

from parameter_server.errors import TransportError
from parameter_server.layout import Layout
from parameter_server.replicas import ReplicaRoute
from parameter_server.worker import PSWorker
from staleflow.runtime.workers.ps_healing import HealingPull


def test_latest_version_names_what_the_replica_holds_and_waits_for_a_newer_one():
    weights = {"w": np.arange(8, dtype=np.float32)}
    layout = Layout.from_arrays(weights)
    with PSWorker.start(layout, 2) as ps, ps.connect("shm") as client:
        client.push(weights, 3)
        route = ReplicaRoute("ps/0", ps.endpoint, same_node=True)
        source = HealingPull(route, layout, lambda replica: ps.endpoint, patience_s=0.5)
        try:
            assert source.latest_version(0) == 3
            assert source.latest_version(3) == 3
            with pytest.raises(TransportError, match="latest version >= 4"):
                source.latest_version(4)  # the replica never gets it within the patience
        finally:
            source.close()
