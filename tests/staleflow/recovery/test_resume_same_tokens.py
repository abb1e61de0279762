"""A multi-turn run killed and resumed trains exactly the tokens of a run straight
through (issue 34, docs/agentic.md "What survives a failure"): the calculator task is
launched twice with the same configuration and seed, once straight through ``STEPS``
steps, once cut with trajectories inside their tool calls and in the middle of a turn,
SIGKILLed, and resumed with ``--resume`` to ``STEPS``. Every step must train the same
trajectories with the same tokens, loss mask, per-token versions, ``V_traj``, prompt
(sample id), finish reason, reward and episode record (turns, tool calls, tool errors and
latencies; ``audit.jsonl``), all but which instance decoded it.

Why η = 0. Sampling is keyed (the embedded engine draws each token from the run's seed,
the trajectory id and the token's position, docs/engines.md), and the calculator's
answers and latencies are functions of the sample and the seed, so a trajectory's tokens
depend only on the weights each token is sampled with. With η > 0 those weights depend
on timing (which version an instance holds when it decodes a token, which buffer a
group lands in), so two runs differ legitimately, killed or not. At η = 0 the run is
synchronous and exactly on-policy: buffer ``v`` is generated with the weights of version
``v`` only, and holds the next ``batch_size`` groups, so each step's trajectories, their
prompts and their weights are fixed by the seed and the steps before it. Equality is
then the correct expectation, up to float rounding: a next turn's KV reused on its
instance and a resumed one re-prefilled give the same tokens and logprobs within
rounding (docs/agentic.md), and such a difference could flip a keyed draw only at a
near tie.

Where the cut comes from. At η = 0 the next buffer's rollout starts only when the
step's weights are pushed, and a step's cut is taken when it is reported, just after
its push begins: the cut after a step holds nothing begun (the straight run's cuts are
printed to show it). The cut that holds trajectories mid-turn and in their tool calls is
the one a stop takes while the rollout runs: the launcher of ``KILLED_AT`` steps is held
``STOP_AFTER_S`` in its ``finishing`` phase (``STALEFLOW_TEST_PAUSE_AT``), after its last
step, while the rollout of the next buffer runs (every tool call takes ``TOOL_S``,
longer than a turn, and each instance decodes one of 16 trajectories at a time), then
stops: the instances are interrupted (a turn in progress comes back whole to the TS,
QUEUED) and the cut is taken with the trajectories whose tool is running REWARDING (a
stop never waits for a tool). Held again in ``auditing``, the launcher is SIGKILLed
there, with those tools still running on the reward worker. The test fails if that
cut holds no trajectory in a tool call or none mid-turn. The resumed launch runs each
of those tools again, once, and continues each partial turn from its tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from staleflow.recovery import list_checkpoints, read_checkpoint
from staleflow.runfolder.run_state import FINISHED, read_state
from staleflow.runtime.workers.audit_trail import read_audit
from tests.staleflow.recovery.agentic_launch import (
    TIMEOUT_S,
    calculator_run,
    crash,
    finish,
    in_phase,
    in_tool_call,
    launch,
    read_json,
    reaped,
    run_folder,
    saved,
    turn_begun,
)
from tests.staleflow.runtime.driver.launch_checks import warm_micro_calculator

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ETA, KILLED_AT, STEPS = 0, 2, 4
# 32 trajectories a step, 16 on each of the 2 instances, decoded one at a time: a tool
# call (TOOL_S) ends before an instance has decoded the other first turns, so instances
# decode without a gap, and a trajectory whose turn ended in the last TOOL_S is inside its
# call. STOP_AFTER_S (a pull, then a few turns) finds both for turns of about 0.15 to 2.5 s;
# with 16 trajectories, 4 s and 4 s, the first turns here (0.35 s each, load 4) had all
# ended and every trajectory was in its call.
BATCH, GROUP = 4, 8
TOOL_S = 3.0
STOP_AFTER_S = 3.0
# what a step trains of a trajectory, compared between the two runs
KEYS = (
    "group_id",
    "sample_id",
    "v_traj",
    "tokens",
    "mask",
    "versions",
    "finish_reason",
    "reward",
    "info",
)


def _args(policy: Path, runs: Path, steps: int) -> list[str]:
    return [
        f"run_dir={runs}",
        f"steps={steps}",
        f"batch_size={BATCH}",
        f"group_size={GROUP}",
        *calculator_run(policy, ETA, TOOL_S),
    ]


def _trained(run_dir: Path) -> dict[int, dict[int, dict[str, Any]]]:
    """step -> trajectory id -> what the step trained of it, from ``audit.jsonl``."""
    out: dict[int, dict[int, dict[str, Any]]] = {}
    lines = read_audit(run_dir / "audit.jsonl")
    twice = [t for t, n in Counter(a["traj_id"] for a in lines).items() if n > 1]
    assert not twice, f"{run_dir.name}: trajectories trained twice: {twice}"
    for a in lines:
        # exactly on-policy: the trajectory, and every token of it, at the step's version
        assert a["v_traj"] == a["version"] and set(a["versions"]) <= {a["version"]}, a
        mask = a.get("mask", [1] * len(a["tokens"]))  # written when not all the model's
        # the episode's record but the instance that decoded its last turn: placement,
        # which differs between two runs (which instance is free first), not training data
        info = {k: v for k, v in (a.get("info") or {}).items() if k != "instance"}
        out.setdefault(a["version"] + 1, {})[a["traj_id"]] = {**a, "mask": mask, "info": info}
    return out


def _differences(straight: dict, resumed: dict) -> list[str]:
    """Every way the resumed run's steps differ from the straight run's, named."""
    out = []
    for step in sorted(set(straight) | set(resumed)):
        a, b = straight.get(step, {}), resumed.get(step, {})
        if set(a) != set(b):
            out.append(f"step {step}: trajectories {sorted(a)} straight, {sorted(b)} resumed")
            continue
        for tid in sorted(a):
            for key in KEYS:
                x, y = a[tid].get(key), b[tid].get(key)
                if x == y:
                    continue
                where = ""
                if isinstance(x, list) and isinstance(y, list):
                    where = f" from index {_first_difference(x, y)} (lengths {len(x)}, {len(y)})"
                out.append(f"step {step}, trajectory {tid}: {key} differs{where}: {x} / {y}")
    return out


def _first_difference(x: list, y: list) -> int:
    n = min(len(x), len(y))
    return next((i for i in range(n) if x[i] != y[i]), n)


def _begun(run_dir: Path) -> dict[str, int]:
    """Checkpoint -> how many trajectories it holds with tokens (begun)."""
    return {
        p.name: sum(1 for s in saved(read_checkpoint(p)).values() if s["tokens"])
        for p in list_checkpoints(run_dir)
    }


@pytest.mark.timeout(1800)
def test_cut_mid_turn_and_mid_tool_call_killed_and_resumed_trains_the_straight_runs_tokens(
    tmp_path,
):
    policy = tmp_path / "policy"
    warm_micro_calculator(policy, positions=256)

    started = time.monotonic()
    runs, log = tmp_path / "straight", tmp_path / "straight.log"
    finish(launch(tmp_path, _args(policy, runs, STEPS), log.name), log)
    (straight,) = [p for p in runs.iterdir() if p.is_dir()]
    took = {"straight": time.monotonic() - started}

    started = time.monotonic()
    runs, log = tmp_path / "runs", tmp_path / "first.log"
    pauses = f"finishing:{STOP_AFTER_S:g},auditing:{TIMEOUT_S:g}"
    proc = launch(tmp_path, _args(policy, runs, KILLED_AT), log.name, pauses=pauses)
    with reaped(proc):
        run_dir = run_folder(proc, runs, log)
        in_phase(proc, run_dir, "auditing", log)  # the stop's cut is written
        crash(proc, run_dir)  # the launcher, and through Ray's reaper its actors
    took["killed"] = time.monotonic() - started
    assert read_state(run_dir).kind != FINISHED and not (run_dir / "summary.json").exists()

    ck = read_checkpoint(list_checkpoints(run_dir)[-1])  # the stop's
    assert ck.steps == KILLED_AT, ck.path
    held = saved(ck)
    in_tool = {t: s for t, s in held.items() if in_tool_call(s)}
    mid_turn = {t: s for t, s in held.items() if s["state"] == "queued" and turn_begun(s)}
    states = dict(Counter(s["state"] for s in held.values()))
    assert "routed" not in states, states  # the stop interrupted every instance
    assert in_tool and mid_turn, (
        f"the stop's cut held {len(in_tool)} trajectories in a tool call and {len(mid_turn)} "
        f"mid-turn ({states}); tune STOP_AFTER_S / TOOL_S:\n{run_dir}"
    )

    started = time.monotonic()
    log = tmp_path / "second.log"
    finish(launch(tmp_path, ["--resume", str(ck.path), f"steps={STEPS}"], log.name), log)
    took["resumed"] = time.monotonic() - started
    summary = read_json(run_dir / "summary.json")
    assert summary is not None and summary["steps"] == STEPS, summary
    assert read_state(run_dir).kind == FINISHED

    a, b = _trained(straight), _trained(run_dir)
    assert sorted(a) == list(range(1, STEPS + 1)), sorted(a)
    assert all(len(trajs) == BATCH * GROUP for trajs in a.values())
    # the first launch sampled what the straight run did, up to the cut
    cut = {**in_tool, **mid_turn}
    for tid, s in cut.items():
        assert tid in a[KILLED_AT + 1], (
            f"trajectory {tid} of the cut is not in step {KILLED_AT + 1}"
        )
        assert a[KILLED_AT + 1][tid]["tokens"][: len(s["tokens"])] == s["tokens"], tid
    diffs = _differences(a, b)
    assert not diffs, (
        f"{len(diffs)} differences (in a tool call at the cut: {sorted(in_tool)}, mid-turn: "
        f"{sorted(mid_turn)}):\n" + "\n".join(d[:400] for d in diffs[:12])
    )
    turns = Counter(t["info"].get("turns") for step in a.values() for t in step.values())
    print(
        f"straight {took['straight']:.0f} s, killed {took['killed']:.0f} s, resumed "
        f"{took['resumed']:.0f} s; the stop's cut after step {KILLED_AT}: {len(in_tool)} in a "
        f"tool call, {len(mid_turn)} mid-turn, {states}; turns per trajectory {dict(turns)}; "
        f"begun at the straight run's cuts: {_begun(straight)}"
    )
