"""``env.sandbox``: environment steps in confined, killable processes. A step that loops
forever is killed with its process at ``env.step_timeout_s``, one that allocates past its
memory is stopped; each trajectory ends with a clear ``env_error`` in its record while
the other trajectory of the same batch completes, and the next steps run. (Without the
sandbox such a step is abandoned on its thread and runs on: ``test_env_stage.py``. The
confinement itself: ``tests/staleflow/rewards/test_rewards_confinement.py``.)"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from staleflow.envs import EnvSample, EpisodeLimits, make_environment
from staleflow.envs.formats import PlainFormat, episode_dataset, tool_tokenizer
from staleflow.rewards.confinement import Limits
from staleflow.rollout.instance import Finished
from staleflow.runtime.interface import Rewarded
from staleflow.runtime.workers.env_sandbox import SandboxedSteps
from staleflow.runtime.workers.env_stage import EnvironmentStage
from staleflow.runtime.workers.reward_stage import RewardStage
from tests.staleflow.runtime.env_turns import model_turn
from trajectory_server import (
    RoutedTrajectory,
    TrajectoryServer,
    TrajectoryServerConfig,
)

TOK = tool_tokenizer("runaway")
FMT = PlainFormat(TOK)
TARGET = "env_sandbox_helpers:Runaway"


@pytest.fixture
def helpers(monkeypatch) -> None:
    # the spawned children inherit sys.path
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


class _Source:
    def __init__(self) -> None:
        samples = [EnvSample(i, f"{i}+1=", str(i + 1)) for i in range(4)]
        self._samples = list(episode_dataset(make_environment(TARGET), samples, FMT))

    def next_sample(self):
        return self._samples.pop(0) if self._samples else None


def _never_scored(items: Sequence[tuple[int, str, str]]) -> list:
    raise AssertionError("an environment task is scored by its environment")


def _finished(ts: TrajectoryServer, routed: RoutedTrajectory, text: str) -> Finished:
    return model_turn(ts, routed, TOK, text)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def test_a_runaway_step_is_killed_and_ends_its_trajectory_while_the_other_goes_on(
    helpers,
) -> None:
    ts = TrajectoryServer(TrajectoryServerConfig(eta=0, batch_size=1, group_size=2), _Source())
    rewarded: list[Rewarded] = []
    sandbox = SandboxedSteps(
        TARGET, {}, timeout_s=2, processes=2, limits=Limits(cpu_s=2, memory_mb=256)
    )
    stage = EnvironmentStage(
        make_environment(TARGET),
        FMT,
        EpisodeLimits(max_turns=2, max_tokens=64),
        ts,
        RewardStage(_never_scored, TOK.decode, ts, rewarded.extend, "w"),
        worker_id="w",
        threads=2,
        step_timeout_s=2,
        sandbox=sandbox,
    )
    try:
        runaway, other = ts.route([0, 1], 0, "i0")
        # both steps at once, on two children: one loops forever, one answers
        done = stage.process([_finished(ts, runaway, "loop"), _finished(ts, other, "ok")])
        assert sorted(done) == [0, 1]
        records = {r.traj_id: r for r in rewarded}
        assert records[0].finish_reason == "env_error" and records[0].reward == 0.0
        assert "took over 2 s (env.step_timeout_s)" in records[0].error
        assert "killed, with every process it started (env.sandbox)" in records[0].error
        assert records[1].finish_reason == "done" and records[1].reward == 1.0
        children = sandbox.pids
        assert len(children) == 2 and all(_alive(pid) for pid in children)
        # the step's own process was killed and reaped, not abandoned and running on
        assert [_children(pid) for pid in children] == [[], []]
        assert sandbox.restarts == 0
        (group,) = ts.take_batch([runaway.group_id]).groups
        kept = {t.traj_id: t for t in group.trajectories}
        # the run's record of the trajectory says why it ended
        assert kept[0].finish_reason == "env_error" and kept[0].reward == 0.0
        assert "its process was killed" in str(kept[0].info["reward_error"])
        assert int(kept[1].info["pid"]) != os.getpid()  # stepped in a child
        # next: a step that allocates past its memory, beside one that answers
        hog, fourth = ts.route([2, 3], 0, "i0")
        done = stage.process([_finished(ts, hog, "hog"), _finished(ts, fourth, "ok")])
        assert sorted(done) == [2, 3]
        records = {r.traj_id: r for r in rewarded}
        assert records[2].finish_reason == "env_error" and records[2].reward == 0.0
        assert "ran out of memory: its process may take 256 MiB" in records[2].error
        assert records[2].error.endswith("(MemoryError) (env.sandbox_memory_mb)")
        assert records[3].finish_reason == "done"
        assert sandbox.pids == children  # the same children served both groups
    finally:
        stage.close()
    assert not any(_alive(pid) for pid in children)  # close stops them


def test_a_sandbox_needs_a_limit() -> None:
    with pytest.raises(ValueError, match="needs a limit"):
        SandboxedSteps(TARGET, {}, timeout_s=0, processes=1)
