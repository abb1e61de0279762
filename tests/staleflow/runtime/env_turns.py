"""A model turn as a rollout actor hands it on, for the environment stage's tests: the
instance generated some text and its end-of-turn token after what it was routed with."""

from __future__ import annotations

import numpy as np

from staleflow.rollout.instance import Finished
from trajectory_server import FinishedTrajectory, RoutedTrajectory


def model_turn(
    ts, routed: RoutedTrajectory, tok, text: str, version: int = 0, reason: str = "stop"
) -> Finished:
    """``text`` and ``tok``'s end of turn after ``routed`` (logprobs -0.5, every new token
    of ``version``), handed to worker ``w`` in ``ts``, as the rollout actor does before
    the environment steps it."""
    new = np.append(tok.encode(text), tok.eos_id).astype(np.int32)
    n = len(new)
    f = Finished(
        routed.traj_id, routed.group_id, routed.v_traj, routed.sample_id, routed.answer,
        routed.prompt, np.concatenate([routed.tokens, new]),
        np.concatenate([routed.logprobs, np.full(n, -0.5, np.float32)]),
        np.concatenate([routed.versions, np.full(n, version, np.int32)]),
        reason, 0, np.concatenate([routed.mask, np.ones(n, bool)]),
    )  # fmt: skip
    ts.hand_to_reward(
        [FinishedTrajectory(f.traj_id, f.tokens, f.logprobs, f.versions, reason, f.mask)], "w"
    )
    return f
