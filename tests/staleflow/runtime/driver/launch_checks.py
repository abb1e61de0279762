"""What every real launch must show, whatever the policy learns (shared by the single-node
and the multi-node launch tests)."""

from __future__ import annotations

from collections import Counter

from staleflow.runfolder.step_record import read_records

# A CI-sized run: the micro model untrained, 2 groups of 4 a step, 8-token responses.
MICRO_RUN = [
    "model.preset=micro",
    "model.warmup=false",
    "batch_size=2",
    "group_size=4",
    "rollout.max_response_tokens=8",
    "coordinator.period_s=0.05",
]


def check_run(result, eta: int, steps: int, trajectories_per_step: int) -> None:
    assert len(result.records) == steps
    ids: Counter[int] = Counter()
    for step in result.consumed:
        assert max(step["staleness"]) <= eta, step
        assert min(step["staleness"]) >= 0
        ids.update(step["traj_ids"])
        assert len(step["traj_ids"]) == trajectories_per_step  # batch x group, with redundancy too
    assert ids and max(ids.values()) == 1, "a trajectory was consumed twice"
    audit = result.summary.audit
    assert audit["routed"] == 0 and audit["on_instances"] == 0, audit
    assert audit["consumed"] == sum(ids.values())
    # dynamic sampling's drops are counted apart (0 when it is off)
    ended = audit["consumed"] + audit["aborted"] + audit["filtered"]
    assert audit["created"] == ended + audit["queued"] + audit["completed"], audit
    # instances moved to newer weights as the PS advanced
    versions = [max(rec.instance_version.values()) for rec in result.records]
    assert versions == sorted(versions), versions  # an instance never loads older weights
    # the last batch (version steps - 1) admits nothing older than steps - 1 - eta, so some
    # instance must have loaded at least that version from the PS before the step's record
    assert versions[-1] >= max(1, steps - 1 - eta), versions
    # metrics.jsonl holds exactly the records the run streamed
    assert read_records(result.run_dir / "metrics.jsonl") == result.records
    assert (result.run_dir / "config.yaml").is_file()
    # the checkpoint is a complete policy: model.checkpoint=<it> resumes from it
    from staleflow.models.checkpoint import load_pretrained

    model, tokenizer = load_pretrained(result.run_dir / "checkpoint")
    assert tokenizer.decode(tokenizer.encode("12+7=")) == "12+7="
    assert sum(p.numel() for p in model.parameters()) > 0
    # the trainer's last Push reached every PS replica
    assert audit["ps_latest"] and set(audit["ps_latest"].values()) == {steps}, audit


def warm_micro_calculator(
    path, positions: int = 128, hidden_size: int = 0, lr: float = 1e-2, steps: int = 50
) -> None:
    """Save at ``path`` the micro model for the calculator task after 50 steps of 16
    tool-use demonstrations at lr 1e-2 (about 6 s on one idle thread): a policy that
    writes tool calls, so that its trajectories take more than one turn. ``positions``:
    its context (micro's own is 128, in which a tool call, about 80 characters, and the
    tool's answer rarely fit). ``hidden_size`` (0: micro's 32): 64 gives heads of 32, the
    smallest vLLM's CPU attention takes."""
    from dataclasses import replace

    from staleflow.data.synthetic import ArithmeticConfig
    from staleflow.envs.calculator import calculator_samples, demonstration
    from staleflow.envs.formats import PlainFormat
    from staleflow.models.checkpoint import save_pretrained
    from staleflow.models.presets import PRESETS
    from staleflow.models.tool_warmup import build_calculator_model, collate_demonstrations
    from staleflow.models.warmup import warmup

    preset = replace(PRESETS["micro"], max_position_embeddings=positions)
    if hidden_size:
        preset = replace(preset, hidden_size=hidden_size)
    model, tok = build_calculator_model(preset, seed=0)
    fmt = PlainFormat(tok)
    task = ArithmeticConfig.level(2, seed=7)

    def batch(step: int):
        samples = calculator_samples(task, 16, 16 * step)
        return collate_demonstrations([demonstration(s, fmt, tok) for s in samples], tok.pad_id)

    warmup(model, tok, None, steps=steps, batch_size=16, lr=lr, batches=batch, log_every=0)
    save_pretrained(model, tok, path)
