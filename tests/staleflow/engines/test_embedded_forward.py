"""The engine's own forward over the slot cache against the HF model's forward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from staleflow.engines.embedded.runner import ModelRunner  # noqa: E402

VOCAB = 48


@pytest.mark.parametrize(
    ("kind", "tied"), [("qwen2", True), ("qwen2", False), ("llama", False), ("qwen3", True)]
)
def test_prefill_and_decode_logits_match_hf(make_model, kind: str, tied: bool) -> None:
    model = make_model(kind, tied=tied)
    runner = ModelRunner(model)
    cache = runner.new_cache(slots=4, max_seq_len=32)
    torch.manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,)) for n in (5, 11, 2)]
    rows = [2, 0, 1]  # out of order on purpose: rows are written where told
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    logits = runner.prefill(
        cache, ids, torch.tensor([len(s) for s in seqs]), torch.tensor(rows), want_logits=True
    )
    with torch.inference_mode():
        for i, s in enumerate(seqs):
            ref = model(s[None]).logits[0]
            torch.testing.assert_close(logits[i, : len(s)], ref, atol=1e-4, rtol=1e-4)
        # Decode reads rows 0..n-1: row r holds seqs[rows.index(r)].
        current = [seqs[rows.index(r)].clone() for r in range(3)]
        for _ in range(4):
            nxt = torch.randint(0, VOCAB, (3,))
            positions = torch.tensor([len(c) for c in current])
            out = runner.decode(cache, nxt, positions)
            current = [torch.cat([c, nxt[j : j + 1]]) for j, c in enumerate(current)]
            for j, c in enumerate(current):
                torch.testing.assert_close(
                    out[j], model(c[None]).logits[0, -1], atol=1e-4, rtol=1e-4
                )


def test_single_request_prefill_uses_causal_path(make_model) -> None:
    model = make_model()
    runner = ModelRunner(model)
    cache = runner.new_cache(slots=1, max_seq_len=16)
    seq = torch.randint(0, VOCAB, (1, 9))
    logits = runner.prefill(cache, seq, torch.tensor([9]), torch.tensor([0]), want_logits=True)
    with torch.inference_mode():
        torch.testing.assert_close(logits[0], model(seq).logits[0], atol=1e-4, rtol=1e-4)


def test_sliding_window_models_are_refused(make_model) -> None:
    import transformers

    cfg = transformers.Qwen2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=VOCAB,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    with pytest.raises(ValueError, match="full attention only"):
        ModelRunner(transformers.Qwen2ForCausalLM(cfg))
