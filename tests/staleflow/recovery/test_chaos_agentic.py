"""A multi-turn run killed and resumed (issue 34, docs/agentic.md "What survives a
failure"): a ``staleflow launch`` subprocess of the calculator task, whose every tool
call takes 2 s, is SIGKILLed (a crash: the launcher and, through Ray's reaper, its
actors), then resumed with ``--resume`` from its newest checkpoint.

The kill lands deterministically: the launcher is held in its ``finishing`` phase
(``STALEFLOW_TEST_PAUSE_AT``, ``staleflow.runfolder.run_state``), after its last step and
before its final checkpoint, while the rollout still runs, and the test kills it when
``state.json`` names that phase, so no checkpoint is written after the test has read
them. The run cuts a checkpoint after every step, live: a cut holds what was then in the
middle of a turn (on an instance) and inside its tool call (with a reward worker). The
run resumes from the newest cut that holds both (``--resume RUN_DIR/checkpoints/step-k``,
so the steps after it are done again); the test fails if none does.

What must hold, from the run folder alone:

- nothing lost or trained twice: resumed to ``eta + 1`` steps after the cut, the run
  trains every trajectory the cut reserved (the others are live at the end), none twice,
  every one within eta;
- a trajectory the cut holds inside its tool call **runs the tool again, once**: its
  trained response is the cut's, then exactly the observation that the environment
  answers to that turn (replayed here from the sample and the seed), and its episode
  record counts each of its tool calls once;
- a trajectory the cut holds in the middle of a turn goes on from the cut's tokens.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from staleflow.engines.base import FINISH_LENGTH
from staleflow.envs import EnvSample, ModelTurn
from staleflow.envs.calculator import CalculatorEnvironment
from staleflow.envs.tool_calls import format_tool_response
from staleflow.recovery import list_checkpoints, read_checkpoint
from staleflow.runfolder.run_state import FINISHED, read_state
from staleflow.runtime.workers.audit_trail import read_audit
from staleflow.runtime.workers.env_stage import turns_of
from tests.staleflow.recovery.agentic_launch import (
    TIMEOUT_S,
    TOK,
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

# eta 3: four buffers' groups are admitted at once, more first turns than the instances
# decode in a step's time, so in steady state the rollout always has a turn to decode when
# a step is cut. The first steps are not steady: the rollout runs ahead while the trainer
# starts, and those buffers are then consumed one right after the other, each cut finding
# only the trajectories just admitted (nothing reported yet).
ETA, STEPS = 3, 7  # killed after step 7
PER_STEP = 2 * 4  # batch x group


def _mid_turn(s: dict) -> bool:
    """On an instance with a model turn begun and not ended."""
    return s["state"] == "routed" and turn_begun(s)


def _replay(a: dict, answer: str) -> tuple[list[str], set[int]]:
    """The observations the calculator answers to the model turns of audit line ``a``
    (from its sample and seed, as the environment stage runs it), and the tool calls its
    record may count: every step once (a last turn cut at the token budget has no step,
    and may look like an episode that ended at its token limit after a step)."""
    env = CalculatorEnvironment(latency_scale_s=0.0)  # the latency changes no answer
    state = env.start(EnvSample.from_json(answer), seed=a["traj_id"]).state
    tokens = np.array(a["tokens"], np.int32)
    observations, calls = [], [0]
    for k, (start, end) in enumerate(turns_of(np.array(a["mask"], bool))):
        ids = tokens[start:end]
        step = env.step(state, ModelTurn(k, TOK.decode(ids), ids))
        calls.append(calls[-1] + int(step.info.get("tool_calls", 0)))
        observations.append(step.observation)
        state = step.state
    counted = {calls[-1]}
    if a["finish_reason"] in ("max_tokens", FINISH_LENGTH):
        counted.add(calls[-2])
    return observations, counted


@pytest.mark.timeout(1500)
def test_a_run_killed_mid_turn_and_mid_tool_call_resumes_rerunning_the_tool_once(tmp_path):
    policy = tmp_path / "policy"
    warm_micro_calculator(policy, positions=256)
    runs = tmp_path / "runs"
    log = tmp_path / "first.log"
    args = [f"run_dir={runs}", f"steps={STEPS}", "batch_size=2", "group_size=4"]
    args += calculator_run(policy, ETA, tool_s=2)
    first = launch(tmp_path, args, "first.log", pauses=f"finishing:{TIMEOUT_S:g}")
    with reaped(first):
        run_dir = run_folder(first, runs, log)
        in_phase(first, run_dir, "finishing", log)
        crash(first, run_dir)  # the launcher, and through Ray's reaper its actors

    state = read_state(run_dir)
    assert state.kind != FINISHED and not (run_dir / "summary.json").exists()
    cuts = []
    for path in list_checkpoints(run_dir):
        cut = read_checkpoint(path)
        held = saved(cut)
        in_tool = {t: s for t, s in held.items() if in_tool_call(s)}
        mid_turn = {t: s for t, s in held.items() if _mid_turn(s)}
        cuts.append((cut, held, in_tool, mid_turn))
    assert len(cuts) >= STEPS - 1, [c.path.name for c, *_ in cuts]
    both = [c for c in cuts if c[2] and c[3]]
    assert both, "no cut held trajectories both inside a tool call and mid-turn: " + "; ".join(
        f"{c.path.name}: {len(t)} in a tool call, {len(m)} mid-turn, "
        f"{dict(Counter(s['state'] for s in held.values()))}"
        for c, held, t, m in cuts
    )
    ck, held, in_tool, mid_turn = both[-1]
    # every trajectory the cut reserved belongs to a buffer of at most ck.steps + eta:
    # resumed to this step count, the run trains them all
    target = ck.steps + ETA + 1

    started = time.monotonic()
    resume = ["--resume", str(ck.path), f"steps={target}"]
    finish(launch(tmp_path, resume, "second.log"), tmp_path / "second.log")
    print(f"resumed run: {time.monotonic() - started:.0f} s")

    # the run reached its step count, once each, within eta
    summary = read_json(run_dir / "summary.json")
    assert summary is not None and summary["steps"] == target, summary
    assert read_state(run_dir).kind == FINISHED
    audit = read_audit(run_dir / "audit.jsonl")
    assert len(audit) == PER_STEP * target
    ids = Counter(a["traj_id"] for a in audit)
    assert max(ids.values()) == 1, "a trajectory was trained on twice"
    for a in audit:
        assert 0 <= a["version"] - a["v_traj"] <= ETA, a
        assert all(a["v_traj"] <= v <= a["version"] for v in a["versions"]), a
    # nothing of the cut lost: consumed, or live at the end (no redundancy: no aborts)
    end = read_checkpoint(list_checkpoints(run_dir)[-1])
    assert end.steps == target
    counters = end.trajectories["counters"]
    live_end = saved(end)
    assert counters["next_traj"] == counters["consumed_trajs"] + len(live_end), counters
    assert counters["aborted_trajs"] == ck.trajectories["counters"]["aborted_trajs"] == 0
    consumed = {a["traj_id"]: a for a in audit}
    assert set(held) <= set(consumed) | set(live_end), set(held) - set(consumed) - set(live_end)

    # inside its tool call at the cut: the same response, then the tool's answer, once
    for tid, s in in_tool.items():
        assert tid in consumed, f"trajectory {tid}, in its tool call at the cut, was not trained"
        a, n = consumed[tid], len(s["tokens"])
        mask = a.get("mask", [1] * len(a["tokens"]))  # written when not all the model's
        assert a["v_traj"] == s["v_traj"] and a["tokens"][:n] == s["tokens"], tid
        assert mask[:n] == [int(m) for m in s["mask"]] and a["versions"][:n] == s["versions"]
        spans = turns_of(np.array(mask, bool))
        k = next(i for i, (start, end) in enumerate(spans) if end == n)  # the turn at the cut
        observations, counted = _replay(a, s["answer"])
        if k + 1 < len(spans):  # the tool's answer, then the next turn
            answer = np.array(a["tokens"][n : spans[k + 1][0]], np.int32)
            assert TOK.decode(answer) == format_tool_response(observations[k]), tid
        else:  # the step ran and ended the episode at a limit: nothing appended
            assert len(a["tokens"]) == n and a["finish_reason"] in ("max_turns", "max_tokens")
        assert a["info"]["turns"] == len(spans) and a["info"]["tool_calls"] in counted, a["info"]

    # in the middle of a turn at the cut: it went on from the cut's tokens
    for tid, s in mid_turn.items():
        assert tid in consumed, f"trajectory {tid}, mid-turn at the cut, was not trained"
        a, n = consumed[tid], len(s["tokens"])
        assert a["v_traj"] == s["v_traj"] and a["tokens"][:n] == s["tokens"], tid
        assert a["versions"][:n] == s["versions"], tid
    print(
        f"resumed from the cut of step {ck.steps} to step {target} ({len(both)} of "
        f"{len(cuts)} cuts held both): {len(in_tool)} trajectories in a tool call, "
        f"{len(mid_turn)} in the middle of a turn, all trained after the resume"
    )
