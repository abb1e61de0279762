"""The embedded trainer's checkpoint keeps torch's RNG state, so a resumed run draws the
same random numbers as the one that never stopped (docs/recovery.md)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from staleflow.config import TrainerConfig  # noqa: E402
from staleflow.models.build import build_arithmetic_model  # noqa: E402
from staleflow.trainers.embedded import EmbeddedTrainer  # noqa: E402


def _trainer(seed: int) -> EmbeddedTrainer:
    model, tokenizer = build_arithmetic_model("micro", seed=seed)
    return EmbeddedTrainer(
        model, TrainerConfig(lr=1e-2), pad_id=tokenizer.pad_id, tokenizer=tokenizer
    )


def test_the_rng_state_survives_a_checkpoint(tmp_path):
    trainer = _trainer(0)
    torch.manual_seed(1234)
    torch.rand(7)  # somewhere in the stream
    trainer.save_checkpoint(tmp_path / "ckpt")
    expected = torch.rand(5)  # what the run that never stopped draws next

    torch.manual_seed(99)  # a fresh process starts elsewhere
    other = _trainer(1)
    other.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(torch.rand(5), expected)
    assert (tmp_path / "ckpt" / "rng.pt").is_file()


def test_a_checkpoint_without_rng_state_still_loads(tmp_path):
    trainer = _trainer(0)
    trainer.save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "rng.pt").unlink()  # written before the RNG was kept
    state = torch.get_rng_state()
    _trainer(1).load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), state)  # left as it was
