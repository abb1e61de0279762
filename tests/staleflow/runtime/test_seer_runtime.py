"""Divided rollout on the real runtime pieces (in process: instance hosts, TS, control
plane, trainer loop): chunks end on the instances and go back to the TS, are re-placed,
and the run keeps eta, conserves every trajectory and trains whole responses."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from staleflow.engines.base import FINISH_LENGTH, EngineOutput
from staleflow.rollout.instance import RolloutInstance
from tests.staleflow.runtime.fakes import EOS, ScriptedEngine
from tests.staleflow.runtime.test_runtime_inprocess import _assert_conserved, run, wire


@pytest.mark.parametrize("eta", [0, 2])
def test_chunks_are_re_placed_and_the_run_keeps_eta_and_loses_nothing(eta):
    w = wire(eta, chunk_tokens=2)
    reports = run(w, steps=5)
    w.control.check()
    seen: Counter[int] = Counter()
    for r, batch in zip(reports, w.trainer.batches, strict=True):
        for g in batch.groups:
            for t in g.trajectories:
                seen[t.traj_id] += 1
                assert r.version - t.v_traj <= eta
                assert (t.versions >= t.v_traj).all()
                # the whole response, over several chunks: the scripted length, one EOS
                assert t.tokens[-1] == EOS and (t.tokens[:-1] != EOS).all()
                assert len(t.tokens) >= 3
                if eta == 0:
                    assert (t.versions == r.version).all()
    assert max(seen.values()) == 1
    _assert_conserved(w)
    chunks = sum(h.times().chunks for h in w.hosts.values())
    assert chunks >= len(seen)  # every response is >= 3 tokens: at least one chunk end
    records = w.control.records()
    if eta == 0:
        assert records[-1].chunks == chunks
    else:  # the rollout runs ahead: chunks may end after the last step's record
        assert 0 < records[-1].chunks <= chunks
    assert records[-1].probe_error is not None and 0.0 <= records[-1].probe_error < 1.0


def test_a_chunk_end_is_told_apart_from_a_response_at_its_budget():
    def out(n, reason=FINISH_LENGTH):
        z = np.zeros(n, np.int32)
        return EngineOutput(1, z, z.astype(np.float32), z, reason)

    inst = RolloutInstance(
        0,
        ScriptedEngine(),
        max_response=16,
        on_finished=lambda finished: None,
        chunk_tokens=4,
        on_chunk=lambda partials: None,
    )
    assert inst._at_chunk_end(out(4))  # stopped for length below the real budget
    assert not inst._at_chunk_end(out(16))  # the real budget: a finished response
    assert not inst._at_chunk_end(out(3, "stop"))  # EOS inside the chunk
    with pytest.raises(ValueError, match="on_chunk"):
        RolloutInstance(
            0, ScriptedEngine(), max_response=16, on_finished=lambda f: None, chunk_tokens=4
        )
