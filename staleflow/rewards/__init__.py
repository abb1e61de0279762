"""Reward functions (chosen by name from a lazy registry) and the reward worker core."""

from staleflow.rewards.base import (
    RewardError,
    RewardFn,
    RewardItem,
    RewardResult,
    RewardTimeout,
    as_reward,
)
from staleflow.rewards.registry import (
    REWARD_NAMES,
    RewardSpec,
    make_reward_fn,
    register_reward,
    resolve_reward_kind,
    reward_names,
    reward_spec,
)
from staleflow.rewards.sandbox import TimeLimitedRewardFn
from staleflow.rewards.simple import arithmetic, exact
from staleflow.rewards.worker import RewardWorker, build_reward_fn

__all__ = [
    "REWARD_NAMES",
    "RewardError",
    "RewardFn",
    "RewardItem",
    "RewardResult",
    "RewardSpec",
    "RewardTimeout",
    "RewardWorker",
    "TimeLimitedRewardFn",
    "arithmetic",
    "as_reward",
    "build_reward_fn",
    "exact",
    "make_reward_fn",
    "register_reward",
    "resolve_reward_kind",
    "reward_names",
    "reward_spec",
]
