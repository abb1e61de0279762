"""Multi-turn training batches for the loss-mask tests: model turns with the micro
model's own logprobs, separated by observation tokens the model did not generate."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from trajectory_server.types import TrainingBatch, TrainingGroup, TrainingTrajectory

# prompt -> (model turn, observation, model turn, reward) per trajectory; every reply
# ends with EOS (appended); the observations are what a tool would answer
EPISODES = {
    "12+3=": (("1", "5", "15", 1.0), ("2", "7", "27", 0.0), ("1", "50", "150", 0.0)),
    "7+8=": (("1", "4", "15", 1.0), ("8", "8", "88", 0.0), ("15", "1", "1", 1.0)),
}


def masked_batch(model, tokenizer, *, shift: float = 0.3) -> TrainingBatch:
    """Trajectories ``turn + observation + turn + EOS``: the model tokens carry the model's
    logprobs (minus ``shift * i`` for the ``i``-th member: a stale behaviour policy) and
    versions 0 then 1, the observations logprob 0.0, the version before and mask False."""
    groups = []
    for g, (prompt, members) in enumerate(EPISODES.items()):
        p = tokenizer.encode(prompt, add_bos=True)
        trajs = []
        for i, (turn, obs, reply, reward) in enumerate(members):
            parts = [tokenizer.encode(turn), tokenizer.encode(obs), tokenizer.encode(reply)]
            parts[2] = np.concatenate([parts[2], [tokenizer.eos_id]])
            tokens = np.concatenate(parts).astype(np.int32)
            a, b = len(parts[0]), len(parts[0]) + len(parts[1])
            mask = np.ones(len(tokens), np.bool_)
            mask[a:b] = False
            ids = torch.from_numpy(np.concatenate([p, tokens]).astype(np.int64))[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            behav = lp[len(p) - 1 :].numpy().astype(np.float32) - np.float32(shift * i)
            behav[~mask] = 0.0
            versions = np.zeros(len(tokens), np.int32)
            versions[b:] = 1
            trajs.append(
                TrainingTrajectory(
                    traj_id=10 * g + i,
                    v_traj=0,
                    tokens=tokens,
                    logprobs=behav,
                    versions=versions,
                    reward=reward,
                    finish_reason="stop",
                    mask=mask,
                )
            )
        groups.append(TrainingGroup(g, g, "", p, tuple(trajs)))
    return TrainingBatch(tuple(groups), (), 1.0)


def map_trajectories(batch: TrainingBatch, fn) -> TrainingBatch:
    """``batch`` with ``fn(trajectory) -> trajectory`` applied to every trajectory."""
    groups = tuple(
        dataclasses.replace(g, trajectories=tuple(fn(t) for t in g.trajectories))
        for g in batch.groups
    )
    return dataclasses.replace(batch, groups=groups)


def perturb_observations(batch: TrainingBatch, seed: int = 0) -> TrainingBatch:
    """The same batch with other behaviour logprobs and versions on every observation
    token (what the policy never generated), and nothing else changed."""
    rng = np.random.default_rng(seed)

    def change(t: TrainingTrajectory) -> TrainingTrajectory:
        lp, ver = t.logprobs.copy(), t.versions.copy()
        obs = ~t.mask
        lp[obs] = rng.uniform(-9.0, 0.0, int(obs.sum())).astype(np.float32)
        ver[obs] = rng.integers(t.v_traj, t.v_traj + 5, int(obs.sum()))
        return dataclasses.replace(t, logprobs=lp, versions=ver)

    return map_trajectories(batch, change)


def unmasked(batch: TrainingBatch) -> TrainingBatch:
    """The same batch with every token trained (the mask all True)."""
    return map_trajectories(
        batch, lambda t: dataclasses.replace(t, mask=np.ones(len(t.tokens), np.bool_))
    )
