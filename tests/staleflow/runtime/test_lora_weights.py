"""The weight path of a LoRA run (``trainer.lora``), in process, no Ray: the driver
publishes the base once and the adapter as version 0; the trainer is built from them and
Pushes adapter versions; an instance loads the base once, then Pulls adapters only, and
samples with the trainer's logprobs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from parameter_server import Layout, VersionedStore  # noqa: E402
from parameter_server.transport.local import LocalTransport  # noqa: E402
from staleflow.config import RolloutConfig, TrainerConfig  # noqa: E402
from staleflow.config.lora import LoraConfig  # noqa: E402
from staleflow.models import build_arithmetic_model  # noqa: E402
from staleflow.models.lora import base_state, with_adapters  # noqa: E402
from staleflow.runtime.workers.instance_host import InstanceHost  # noqa: E402
from staleflow.runtime.workers.specs import (  # noqa: E402
    EnginePlacement,
    RolloutSpec,
    TrainerSpec,
    build_embedded_engine,
    build_embedded_trainer,
    initial_weights,
    model_spec,
)
from staleflow.runtime.workers.weight_transfer import TransportPullSource  # noqa: E402
from tests.staleflow.engines.test_embedded_lora import T, _generate, _scored  # noqa: E402
from tests.staleflow.trainers.test_trainers_embedded import _batch  # noqa: E402

LORA = LoraConfig(enabled=True, rank=4, alpha=16.0)


class _CountingSource(TransportPullSource):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.base_pulls = 0

    def fetch_base(self):  # type: ignore[no-untyped-def]
        self.base_pulls += 1
        return super().fetch_base()


def test_a_lora_run_moves_the_base_once_and_adapters_per_version():
    # the driver: the policy with fresh adapters; the PS gets the base once, then v0
    policy, tokenizer = build_arithmetic_model("micro", seed=0)
    with_adapters(policy, LORA, seed=0)
    spec = model_spec(policy, tokenizer, LORA)
    weights, base = initial_weights(policy, spec)
    assert base is not None
    layout, (base_layout, base_weights) = Layout.from_dict(spec.layout), base
    assert set(layout.names) == set(weights) and all(".lora_" in n for n in layout.names)
    store = VersionedStore(layout, num_slots=3, base=base_layout)
    store.push_base(base_weights)
    store.push(weights, 0)
    info = store.info()
    assert info.version_bytes == layout.nbytes < info.base_bytes == base_layout.nbytes

    # the trainer: its base and its first adapter from the PS; adapter versions back
    trainer_source = TransportPullSource(LocalTransport(store), layout)
    version, first = trainer_source.fetch(0)
    assert version == 0
    trainer = build_embedded_trainer(
        TrainerSpec(spec, TrainerConfig(lr=5e-2, lora=LORA), seed=0),
        first,
        trainer_source.fetch_base(),
    )
    for v in range(2):
        trainer.train_step(_batch(trainer.model, tokenizer, version=v))
        assert store.push(trainer.export_weights()) == v + 1
    assert store.info().version_bytes == layout.nbytes  # each Push: the adapter alone

    # an instance: the base once, at start, then the newest adapter
    rollout = RolloutConfig(temperature=T)
    engine = build_embedded_engine(
        RolloutSpec(spec, rollout, max_seq_len=64, kv_budget_tokens=512, seed=3),
        3,
        EnginePlacement(placement_group=None),
    )
    source = _CountingSource(LocalTransport(store), layout)
    host = InstanceHost(0, engine, ts=None, weights=source, max_response=12, on_finished=list)  # type: ignore[arg-type]
    assert host.start(at_least=2) == 2
    host.pull(2)  # a later Pull: the adapter only
    host.stop()
    assert source.base_pulls == 1
    for name, value in base_state(engine._model).items():
        np.testing.assert_array_equal(value.numpy(), base_weights[name])
    for prompt, tokens, logprobs in _generate(engine, tokenizer):
        np.testing.assert_allclose(
            logprobs, _scored(trainer._backend.logits, prompt, tokens), atol=2e-5
        )
