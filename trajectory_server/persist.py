"""Checkpoints of the trajectory server: every live trajectory as columns of arrays.

``export_state`` gives plain data (ints, strs, lists, dicts and 1-D numpy arrays, ready
for msgpack with the wire codec's array extension): the responses of all trajectories
concatenated into one int32 token array, one float32 logprob array, one int32 version
array and one bool loss-mask array with offsets, never lists of Python ints. A state
written before the mask was kept has no ``mask`` column: its responses were all the
model's, so they load with an all-True mask. ``load`` rebuilds a store from it:

- QUEUED trajectories come back in their MLQ order;
- ROUTED ones come back QUEUED (their instance is gone after a restart) with the longest
  response the TS knew (routed, or last reported progress) and their ``V_traj``, at the
  back of their level; the staleness manager still holds their reservations;
- a multi-turn trajectory keeps its environment's packed state (``env_state``, absent in
  states written before it was kept: none);
- REWARDING ones keep their finished response and wait for a worker
  (``reassign_rewards(None, worker)``); COMPLETED ones are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from staleness.bounds import config_problem
from trajectory_server.errors import CorruptState, InvalidConfig
from trajectory_server.records import QUEUED, ROUTED, GroupRecord, TrajRecord
from trajectory_server.store import TrajectoryStore, as_prompt
from trajectory_server.types import TrajectoryServerConfig, TrajState

FORMAT = 1
# Settings that change what the saved trajectories mean; capacity and refill may change.
PROTOCOL_KEYS = ("eta", "batch_size", "group_size", "group_redundancy", "batch_redundancy")
# staleness.bounds.config_problem's order
_BOUNDED_KEYS = ("eta", "batch_size", "group_size", "batch_redundancy", "group_redundancy")
_COUNTERS = (
    "next_traj",
    "next_group",
    "consumed_trajs",
    "aborted_trajs",
    "consumed_groups",
    "aborted_groups",
)
# counters added since format 1: absent from older states, where they were 0
_LATER_COUNTERS = ("filtered_trajs", "filtered_groups")


def _concat(parts: list[np.ndarray], dtype: type) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    data = np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)
    return data, offsets


def source_state(source: object) -> Any:
    """The prompt source's position (``ResumableSource.state()``), None if it has none."""
    state = getattr(source, "state", None)
    return state() if callable(state) else None


def export_state(
    store: TrajectoryStore, config: TrajectoryServerConfig, source: Any
) -> dict[str, Any]:
    queued = [store.trajs[r.traj_id] for r in store.mlq.view()]
    others = sorted(
        (t for t in store.trajs.values() if t.state is not QUEUED), key=lambda t: t.traj_id
    )
    trajs = queued + others
    groups = list(store.groups.values())
    prompt, prompt_offsets = _concat([g.prompt for g in groups], np.int32)
    tokens, offsets = _concat([t.tokens for t in trajs], np.int32)
    return {
        "format": FORMAT,
        "config": {key: getattr(config, key) for key in PROTOCOL_KEYS},
        "counters": {key: getattr(store, key) for key in _COUNTERS + _LATER_COUNTERS},
        "exhausted": store.exhausted,
        "source": source,
        # holders declared lost stay fenced after a restore (a message sent before the
        # stop can still be in flight when a cluster is shared)
        "lost": sorted(store.lost, key=str),
        "groups": {
            "id": np.array([g.group_id for g in groups], dtype=np.int64),
            "sample_id": np.array([g.sample_id for g in groups], dtype=np.int64),
            "answer": [g.answer for g in groups],
            "prompt": prompt,
            "prompt_offsets": prompt_offsets,
        },
        "trajectories": {
            "id": np.array([t.traj_id for t in trajs], dtype=np.int64),
            "group": np.array([t.group.group_id for t in trajs], dtype=np.int64),
            "state": [t.state.value for t in trajs],
            "v_traj": np.array([-1 if t.v_traj is None else t.v_traj for t in trajs], np.int64),
            "holder": [t.holder for t in trajs],
            "reward": np.array([t.reward for t in trajs], dtype=np.float64),
            "finish_reason": [t.finish_reason for t in trajs],
            "info": [dict(t.info) for t in trajs],
            "tokens": tokens,
            "logprobs": _concat([t.logprobs for t in trajs], np.float32)[0],
            "versions": _concat([t.versions for t in trajs], np.int32)[0],
            "mask": _concat([t.mask for t in trajs], np.bool_)[0],
            "env_state": [t.env_state for t in trajs],
            "offsets": offsets,
        },
    }


def check_config(config: TrajectoryServerConfig, state: Mapping[str, Any]) -> None:
    saved = state.get("config")
    if not isinstance(saved, Mapping):
        raise CorruptState("trajectory server state lacks its 'config'")
    # settings no run could have had (batch_size=0) are a damaged state, not another run's
    problem = config_problem(*(saved.get(key) for key in _BOUNDED_KEYS))
    if problem is not None:
        raise CorruptState(
            f"trajectory server state field 'config': {problem}. Here the saved state was "
            "damaged or edited: restore an earlier one, not this one"
        )
    for key in PROTOCOL_KEYS:
        if saved.get(key) != getattr(config, key):
            raise InvalidConfig(
                f"the saved trajectories were made with {key}={saved.get(key)!r}, this server "
                f"has {key}={getattr(config, key)!r}; restore with the run's own settings"
            )


def load(
    store: TrajectoryStore, config: TrajectoryServerConfig, state: Any, source: Any
) -> tuple[int, ...]:
    """Fill an empty ``store`` from ``export_state()``; returns the ids of the trajectories
    that were ROUTED and are QUEUED again. Raises ``CorruptState`` (nothing usable) or
    ``InvalidConfig`` (another run's settings, or a source at another position)."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise CorruptState(f"unsupported trajectory server state format {got!r}; want {FORMAT}")
    check_config(config, state)
    if state.get("source") is not None and source != state["source"]:
        raise InvalidConfig(
            f"the prompt source is at {source!r} but the saved one was at {state['source']!r}; "
            "build it from the checkpoint's sampler state (PromptSampler.from_state)"
        )
    try:
        return _load(store, config, state)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if isinstance(exc, CorruptState | InvalidConfig):
            raise
        raise CorruptState(f"trajectory server state is missing or has a bad field: {exc}") from exc


def _array(columns: Mapping[str, Any], key: str, dtype: type, n: int | None) -> np.ndarray:
    arr = columns[key]
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.dtype(dtype):
        raise CorruptState(f"trajectory server state: '{key}' must be a 1-D {dtype.__name__} array")
    if n is not None and len(arr) != n:
        raise CorruptState(f"trajectory server state: '{key}' has {len(arr)} entries, want {n}")
    return arr


def _slices(data: np.ndarray, offsets: np.ndarray, what: str) -> list[np.ndarray]:
    if (
        len(offsets) == 0
        or offsets[0] != 0
        or offsets[-1] != len(data)
        or (np.diff(offsets) < 0).any()
    ):
        raise CorruptState(f"trajectory server state: the offsets of '{what}' do not fit it")
    data = data.copy()  # one read-only buffer that the loaded records share
    data.flags.writeable = False
    return [data[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]


def _load(
    store: TrajectoryStore, config: TrajectoryServerConfig, state: Mapping[str, Any]
) -> tuple[int, ...]:
    for key in _COUNTERS + _LATER_COUNTERS:
        value = state["counters"][key] if key in _COUNTERS else state["counters"].get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CorruptState(f"trajectory server state: counter '{key}' must be an int >= 0")
        setattr(store, key, value)
    store.exhausted = bool(state["exhausted"])
    lost = state.get("lost", [])  # absent in states written before it was kept
    if not isinstance(lost, list) or not all(
        isinstance(h, int | str) and not isinstance(h, bool) for h in lost
    ):
        raise CorruptState("trajectory server state: 'lost' must be a list of holder ids")
    store.lost = set(lost)
    g = state["groups"]
    gids = _array(g, "id", np.int64, None)
    n_groups = len(gids)
    prompts = _slices(
        _array(g, "prompt", np.int32, None),
        _array(g, "prompt_offsets", np.int64, n_groups + 1),
        "prompt",
    )
    sample_ids = _array(g, "sample_id", np.int64, n_groups).tolist()
    if len(g["answer"]) != n_groups:
        raise CorruptState("trajectory server state: one 'answer' per group is needed")
    for gid, sample_id, answer, prompt in zip(
        gids.tolist(), sample_ids, g["answer"], prompts, strict=True
    ):
        if gid in store.groups or not 0 <= gid < store.next_group:
            raise CorruptState(f"trajectory server state: group id {gid} is repeated or never made")
        store.groups[gid] = GroupRecord(gid, sample_id, str(answer), as_prompt(prompt, sample_id))
    t = state["trajectories"]
    ids = _array(t, "id", np.int64, None)
    n = len(ids)
    offsets = _array(t, "offsets", np.int64, n + 1)
    tokens = _slices(_array(t, "tokens", np.int32, None), offsets, "tokens")
    logprobs = _slices(_array(t, "logprobs", np.float32, None), offsets, "logprobs")
    versions = _slices(_array(t, "versions", np.int32, None), offsets, "versions")
    if "mask" in t:
        masks = _slices(_array(t, "mask", np.bool_, None), offsets, "mask")
    else:  # written before the mask was kept: every response was the model's alone
        masks = _slices(np.ones(int(offsets[-1]), dtype=np.bool_), offsets, "mask")
    env_states = t.get("env_state", [b""] * n)  # absent before multi-turn trajectories
    if len(env_states) != n or not all(isinstance(e, bytes) for e in env_states):
        raise CorruptState(
            "trajectory server state: 'env_state' must hold one bytes per trajectory"
        )
    columns = zip(
        ids.tolist(),
        _array(t, "group", np.int64, n).tolist(),
        t["state"],
        _array(t, "v_traj", np.int64, n).tolist(),
        t["holder"],
        _array(t, "reward", np.float64, n).tolist(),
        t["finish_reason"],
        t["info"],
        tokens,
        logprobs,
        versions,
        masks,
        env_states,
        strict=True,
    )
    requeued: list[TrajRecord] = []
    per_group = config.trajectories_per_group
    for (
        tid,
        gid,
        raw_state,
        v,
        _holder,
        reward,
        finish_reason,
        info,
        tok,
        lp,
        ver,
        m,
        env,
    ) in columns:
        group = store.groups.get(gid)
        if group is None or tid in store.trajs or not 0 <= tid < store.next_traj:
            raise CorruptState(f"trajectory {tid}: unknown group {gid}, repeated or never made")
        traj = TrajRecord(tid, group)
        traj.state = TrajState(raw_state)
        traj.v_traj = None if v < 0 else v
        if traj.v_traj is None and (traj.state is not QUEUED or len(tok)):
            raise CorruptState(f"trajectory {tid}: only an initial QUEUED one may lack V_traj")
        if len(ver) and int(ver.min()) < v:
            raise CorruptState(f"trajectory {tid}: a token is older than its V_traj={v}")
        traj.tokens, traj.logprobs, traj.versions, traj.mask = tok, lp, ver, m
        traj.env_state = env
        traj.reward, traj.finish_reason, traj.info = float(reward), str(finish_reason), dict(info)
        if traj.state is ROUTED:  # its instance did not survive the restart
            traj.state = QUEUED
            requeued.append(traj)
            store.trajs[tid] = traj  # indexed below, after the saved queue
            continue
        traj.holder = None  # no reward worker survives a restart either
        store.insert(traj)
    for traj in requeued:
        del store.trajs[traj.traj_id]
        store.insert(traj)
    for group in store.groups.values():
        if not group.members or len(group.members) > per_group:
            raise CorruptState(
                f"group {group.group_id}: {len(group.members)} live trajectories, "
                f"want 1..{per_group}"
            )
        group.members = dict(sorted(group.members.items()))  # creation order
    return tuple(t.traj_id for t in requeued)
