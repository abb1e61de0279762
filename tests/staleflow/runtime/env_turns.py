"""A model turn as a rollout actor hands it on, for the environment stage's tests: the
instance generated some text and its end-of-turn token after what it was routed with."""

from __future__ import annotations

import numpy as np

from staleflow.rollout.instance import Finished
from trajectory_server import FinishedTrajectory, RoutedTrajectory
from trajectory_server.types import RewardTask


def model_turn(
    ts, routed: RoutedTrajectory, tok, text: str, version: int = 0, reason: str = "stop"
) -> Finished:
    """``text`` and ``tok``'s end of turn after ``routed`` (logprobs -0.5, every new token
    of ``version``), handed to worker ``w`` in ``ts``, as the rollout actor does before
    the environment steps it."""
    new = np.append(tok.encode(text), tok.eos_id).astype(np.int32)
    n = len(new)
    t = RewardTask(
        routed.traj_id, routed.group_id, routed.v_traj, routed.sample_id, routed.answer,
        routed.prompt, np.concatenate([routed.tokens, new]),
        np.concatenate([routed.logprobs, np.full(n, -0.5, np.float32)]),
        np.concatenate([routed.versions, np.full(n, version, np.int32)]),
        reason, np.concatenate([routed.mask, np.ones(n, bool)]),
    )  # fmt: skip
    ts.hand_to_reward(
        [FinishedTrajectory(t.traj_id, t.tokens, t.logprobs, t.versions, reason, t.mask)], "w"
    )
    return Finished(t, 0)


class _Source:
    def __init__(self, dataset) -> None:
        self._samples = list(dataset)

    def next_sample(self):
        return self._samples.pop(0) if self._samples else None


def env_stage_on_file(tmp_path, env_name: str, rows: list[dict], tok, filename: str):
    """``rows`` written to a local JSONL file, launched as ``data.task=env`` with
    ``env.name=env_name`` as the launcher prepares it (preflight, the dataset, the
    environment spec), on a real TS of one trajectory per batch and the reward stage
    that steps the environment: (dataset, ts, stage)."""
    import json

    from staleflow.config import load_config
    from staleflow.runtime.driver.launch import build_dataset
    from staleflow.runtime.driver.launch_checks import preflight
    from staleflow.runtime.driver.run_plan import plan_run
    from staleflow.runtime.workers.specs import RewardSpec, build_reward_stage
    from trajectory_server import TrajectoryServer, TrajectoryServerConfig

    path = tmp_path / filename
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        None,
        [
            "data.task=env",
            f"env.name={env_name}",
            f"data.path={path}",
            f"model.checkpoint={tmp_path}",  # a folder: the policy is never loaded here
        ],
    )
    plan = plan_run(cfg)
    preflight(plan)
    dataset = build_dataset(plan.task, tok)
    spec = plan.environment()
    assert spec is not None
    ts = TrajectoryServer(
        TrajectoryServerConfig(eta=0, batch_size=1, group_size=1), _Source(dataset)
    )
    stage = build_reward_stage(
        RewardSpec(plan.reward, ("char", tok.alphabet), spec), ts, [].extend, "w"
    )
    return dataset, ts, stage
