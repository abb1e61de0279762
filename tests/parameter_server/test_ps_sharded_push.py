"""A Push made by many senders (every trainer rank sends its own shards) into a real PS
worker process: the plan covers every byte once and balances replicas, the version is
published whole or not at all, and out-of-order or inconsistent senders are refused by
name without harming the latest version."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from parameter_server.convert_megatron import (
    GPTConfig,
    MegatronToHF,
    gpt_config_from_hf,
    pipeline_stage,
    unsupported_hf,
)
from parameter_server.errors import LayoutError, LayoutMismatchError, PushVersionError
from parameter_server.shard_push import ShardPushClient, plan_shard_push
from parameter_server.transport import connect
from parameter_server.worker import PSWorker

CONFIG = GPTConfig(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=32,
    vocab_size=24,
    hf_vocab_size=21,
    qkv_bias=True,
    te_fused_layernorm=False,
)


def _hf(conv: MegatronToHF, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in conv.target_layout}


@pytest.mark.parametrize(("tp", "dp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_plan_sends_every_staged_byte_once_and_balances_replicas(tp, dp):
    conv = MegatronToHF(CONFIG, tp)
    staging = conv.staging_layout()
    tp_ranks = [g % tp for g in range(tp * dp)]
    replicas = ["ps/0", "ps/1"]
    plan = plan_shard_push(conv, tp_ranks, replicas)
    for replica in replicas:  # every PS replica gets every staged byte, once
        covered = np.zeros(staging.nbytes, dtype=np.int32)
        for g, by_replica in plan.items():
            for p in by_replica[replica]:
                assert p.staged.name == f"tp{tp_ranks[g]}/{p.name}"  # only its own shard
                covered[p.staged.start : p.staged.stop] += 1
        for spec in staging:
            start = staging.offset(spec.name)
            assert (covered[start : start + spec.nbytes] == 1).all(), (replica, spec.name)
    sent = [sum(p.staged.nbytes for ps in plan[g].values() for p in ps) for g in range(tp * dp)]
    assert max(sent) <= 1.1 * len(replicas) * staging.nbytes / (tp * dp) + 64


@pytest.mark.parametrize(("tp", "dp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_pipeline_stages_send_only_their_own_layers(tp, dp):
    """PP = 2 over the two layers: every staged byte still reaches every replica once, and
    a rank sends only the parameters of its stage (embedding first, final norm last)."""
    conv = MegatronToHF(CONFIG, tp)
    staging = conv.staging_layout()
    world = tp * dp * 2
    tp_ranks = [g % tp for g in range(world)]
    stages = [g // (tp * dp) for g in range(world)]
    replicas = ["ps/0", "ps/1"]
    plan = plan_shard_push(conv, tp_ranks, replicas, stages)
    for replica in replicas:
        covered = np.zeros(staging.nbytes, dtype=np.int32)
        for g, by_replica in plan.items():
            for p in by_replica[replica]:
                assert p.staged.name == f"tp{tp_ranks[g]}/{p.name}"
                assert pipeline_stage(p.name, CONFIG.num_layers, 2) == stages[g], (g, p.name)
                covered[p.staged.start : p.staged.stop] += 1
        assert (covered == 1).all(), replica
    names = {g: {p.name for ps in plan[g].values() for p in ps} for g in plan}
    assert "embedding.word_embeddings.weight" in names[0]
    assert "decoder.final_layernorm.weight" in names[world - 1]
    assert not any(n.startswith("decoder.layers.1.") for n in names[0])
    with pytest.raises(LayoutError, match="2 layers do not split into 3"):
        pipeline_stage("decoder.layers.0.mlp.linear_fc1.weight", 2, 3)


@pytest.fixture
def worker():
    conv = MegatronToHF(CONFIG, 2)
    w = PSWorker.start(conv.target_layout, 3)
    with connect(w.endpoint, "auto") as client:
        client.push(_hf(conv), 0)
    yield w
    w.stop()


def _pull(endpoint) -> tuple[int, dict[str, np.ndarray]]:
    with connect(endpoint, "auto") as client:
        buffer = np.empty(client.layout.nbytes, dtype=np.uint8)
        version = client.pull(buffer)
        return version, {k: v.copy() for k, v in client.layout.views(buffer).items()}


def _clients(endpoint, conv, tp_ranks):
    return [
        ShardPushClient(endpoint, conv, rank=g, tp_ranks=tp_ranks) for g in range(len(tp_ranks))
    ]


def test_four_ranks_push_one_version_that_readers_see_whole(worker):
    conv = MegatronToHF(CONFIG, 2)
    tp_ranks = [0, 1, 0, 1]  # TP = 2 x DP = 2
    clients = _clients(worker.endpoint, conv, tp_ranks)
    new = _hf(conv, seed=1)
    shards = conv.split(new)
    # three of four senders: nothing new is visible yet
    results = [clients[g].push(shards[tp_ranks[g]], 1) for g in range(3)]
    assert results == [None, None, None]
    assert _pull(worker.endpoint)[0] == 0
    assert clients[3].push(shards[tp_ranks[3]], 1) == 1  # the last one publishes
    version, pulled = _pull(worker.endpoint)
    assert version == 1
    assert all(np.array_equal(pulled[k], new[k]) for k in new)
    # concurrently, the next version
    newer = _hf(conv, seed=2)
    shards = conv.split(newer)
    threads = [
        threading.Thread(target=clients[g].push, args=(shards[tp_ranks[g]], 2)) for g in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    version, pulled = _pull(worker.endpoint)
    assert version == 2 and all(np.array_equal(pulled[k], newer[k]) for k in newer)


def _rank_groups(conv, workers, tp_ranks):
    """Version 0 on every worker, and each rank's ShardPushGroup to all of them (rank g
    shares a node with replica g % 2; the plan takes every link as equal)."""
    from parameter_server.replicas import ReplicaRoute
    from parameter_server.shard_push import ShardPushGroup

    for w in workers:
        with connect(w.endpoint, "auto") as client:
            client.push(_hf(conv), 0)
    routes = {
        g: [
            ReplicaRoute(f"ps/{k}", w.endpoint, same_node=k == g % len(workers))
            for k, w in enumerate(workers)
        ]
        for g in range(len(tp_ranks))
    }
    return [
        ShardPushGroup(conv, rank=g, tp_ranks=tp_ranks, routes=routes) for g in range(len(tp_ranks))
    ]


def test_four_ranks_push_every_version_whole_to_two_replicas():
    """TP = 2 x DP = 2 ranks, two PS replicas (App. A.1): each rank sends each replica the
    pieces the plan gives it there (an empty message where none), concurrently; each
    replica publishes every version whole, and readers of either see the same weights."""
    from parameter_server.shard_push import ShardPushGroup

    conv = MegatronToHF(CONFIG, 2)
    workers = [PSWorker.start(conv.target_layout, 3) for _ in range(2)]
    groups: list[ShardPushGroup] = []
    try:
        tp_ranks = [0, 1, 0, 1]
        groups = _rank_groups(conv, workers, tp_ranks)
        per_replica = [sum(grp.sent_bytes()[f"ps/{k}"] for grp in groups) for k in range(2)]
        assert per_replica == [conv.staging_layout().nbytes] * 2  # each gets it all, once
        assert all(set(grp.sent_bytes()) == {"ps/0", "ps/1"} for grp in groups)
        for version in (1, 2):
            new = _hf(conv, seed=version)
            shards = conv.split(new)
            results: list[object] = [None] * 4

            def send(g: int, shards=shards, version=version, results=results) -> None:
                results[g] = groups[g].push(shards[tp_ranks[g]], version)

            threads = [threading.Thread(target=send, args=(g,)) for g in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert set(results) <= {None, version}  # version: the last sender on both
            for w in workers:
                got, pulled = _pull(w.endpoint)
                assert got == version
                assert all(np.array_equal(pulled[k], new[k]) for k in new)
    finally:
        for grp in groups:
            grp.close()
        for w in workers:
            w.stop()


def test_ranks_must_reach_the_same_replicas():
    from parameter_server.replicas import ReplicaRoute
    from parameter_server.shard_push import ShardPushGroup
    from parameter_server.transport.base import Endpoint

    conv = MegatronToHF(CONFIG, 2)
    e = Endpoint("unix:/nowhere", "h", "b", "")
    routes = {0: [ReplicaRoute("ps/0", e, True)], 1: [ReplicaRoute("ps/1", e, True)]}
    with pytest.raises(ValueError, match=r"same replicas \['ps/0'\] \(ranks \[1\] differ\)"):
        ShardPushGroup(conv, rank=0, tp_ranks=[0, 1], routes=routes)


def test_out_of_order_and_inconsistent_senders_are_refused(worker):
    conv = MegatronToHF(CONFIG, 2)
    clients = _clients(worker.endpoint, conv, [0, 1])
    shards = conv.split(_hf(conv, seed=3))
    with pytest.raises(PushVersionError, match="latest is 0; versions advance by one"):
        clients[0].push(shards[0], 5)
    assert clients[0].push(shards[0], 1) is None  # the refusal left the stream usable
    with pytest.raises(PushVersionError, match="sender 0 already pushed version 1"):
        clients[0].push(shards[0], 1)
    with pytest.raises(PushVersionError, match="still waits for senders \\[1\\]"):
        clients[1].push(shards[1], 2)
    # replicated norms that differ between TP ranks: refused, the latest stays intact
    bad = {k: v.copy() for k, v in shards[1].items()}
    bad["decoder.final_layernorm.weight"] += 1.0
    with pytest.raises(LayoutMismatchError, match="differs between TP rank 0 and 1"):
        clients[1].push(bad, 1)
    assert _pull(worker.endpoint)[0] == 0


def test_a_trainer_of_another_model_is_refused_at_declaration(worker):
    other = MegatronToHF(GPTConfig(**{**CONFIG.__dict__, "ffn_hidden_size": 64}), 2)
    with pytest.raises(LayoutMismatchError, match="convert to a different model than the PS"):
        ShardPushClient(worker.endpoint, other, rank=0, tp_ranks=[0, 1])


def test_one_ranks_shard_is_its_part_of_the_split():
    conv = MegatronToHF(CONFIG, 2)
    hf = _hf(conv)
    split = conv.split(hf)
    for r in range(2):
        assert all(np.array_equal(conv.shard(hf, r)[k], split[r][k]) for k in split[r])
    with pytest.raises(LayoutError, match="TP rank 2 is outside"):
        conv.shard(hf, 2)


QWEN2 = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 17,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def test_megatron_shapes_from_hf_configs():
    qwen2 = gpt_config_from_hf(QWEN2, tp=2)
    assert (qwen2.qkv_bias, qwen2.qk_layernorm, qwen2.tie_word_embeddings) == (True, False, True)
    assert (qwen2.vocab_size, qwen2.hf_vocab_size, qwen2.head_dim) == (256, 17, 8)
    qwen3 = gpt_config_from_hf({**QWEN2, "model_type": "qwen3", "head_dim": 16})
    assert (qwen3.qkv_bias, qwen3.qk_layernorm, qwen3.head_dim) == (False, True, 16)
    llama = gpt_config_from_hf({**QWEN2, "model_type": "llama", "attention_bias": False})
    assert (llama.qkv_bias, llama.qk_layernorm) == (False, False)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not one of llama, qwen2, qwen3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not silu"),
        ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type 'llama3'"),
        ({"use_sliding_window": True}, "sliding-window attention"),
    ],
)
def test_models_without_a_megatron_layout_are_named(change, why):
    assert why in unsupported_hf({**QWEN2, **change})
    with pytest.raises(LayoutError, match="no Megatron layout"):
        gpt_config_from_hf({**QWEN2, **change})


def test_a_lost_replica_is_left_out_then_refilled_whole_at_its_new_endpoint():
    """TP = 2 x DP = 2 ranks, two replicas; ``ps/1``'s process is killed in the middle of
    version 2 (two ranks had sent it their pieces). The ranks go on Pushing to ``ps/0``;
    once ``ps/1`` is restarted empty at a new endpoint, every rank reconnects (the two
    that saw it fail and the two that did not) and sends it version 2: it publishes
    version 2 whole, and version 3 reaches both replicas."""
    import os
    import signal

    from parameter_server.shard_push import ShardPushGroup

    conv = MegatronToHF(CONFIG, 2)
    workers = [PSWorker.start(conv.target_layout, 3) for _ in range(2)]
    groups: list[ShardPushGroup] = []
    tp_ranks = [0, 1, 0, 1]

    def push(ranks, version, new, *, only=None):
        shards = conv.split(new)
        results: dict[int, object] = {}

        def send(g: int) -> None:
            if only is None:
                results[g] = groups[g].push(shards[tp_ranks[g]], version)
            else:
                results[g] = groups[g].push_to(only, shards[tp_ranks[g]], version)

        threads = [threading.Thread(target=send, args=(g,)) for g in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    try:
        groups = _rank_groups(conv, workers, tp_ranks)
        push(range(4), 1, _hf(conv, seed=1))
        v2 = _hf(conv, seed=2)
        assert set(push([0, 1], 2, v2).values()) == {None}  # half of version 2 on both
        os.kill(workers[1].pid, signal.SIGKILL)
        while workers[1].alive:
            time.sleep(0.01)
        assert set(push([2, 3], 2, v2).values()) <= {None, 2}  # ps/0 publishes it
        assert [g.lost for g in groups] == [set(), set(), {"ps/1"}, {"ps/1"}]
        assert _pull(workers[0].endpoint)[0] == 2
        lost = workers[1]
        lost.stop()  # frees what the killed process left: its shared memory and socket
        workers[1] = PSWorker.start(conv.target_layout, 3)  # restarted: empty, new endpoint
        endpoints = {f"ps/{k}": w.endpoint for k, w in enumerate(workers)}
        assert [g.reconnect(endpoints) for g in groups] == [["ps/1"]] * 4
        assert [g.lost for g in groups] == [set()] * 4
        push(range(4), 2, v2, only=["ps/1"])
        version, pulled = _pull(workers[1].endpoint)
        assert version == 2 and all(np.array_equal(pulled[k], v2[k]) for k in v2)
        v3 = _hf(conv, seed=3)
        push(range(4), 3, v3)
        for w in workers:
            version, pulled = _pull(w.endpoint)
            assert version == 3 and all(np.array_equal(pulled[k], v3[k]) for k in v3)
    finally:
        for grp in groups:
            grp.close()
        for w in workers:
            w.stop()
