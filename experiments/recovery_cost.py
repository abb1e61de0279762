"""What losing a rollout instance costs: the tokens that must be generated again.

A rollout instance dies with trajectories half generated. StaleFlow's TS keeps the
longest response it knows of each (what the instance reported last, every
``recovery.progress_every_s``), gives them back to the queue with their ``V_traj`` and
reservation, and another instance continues after that prefix: only the tokens
generated since the last report are generated again, never more than the instance had
in flight. A system that restarts lost work from the prompt regenerates all of it.

Each round runs the real control plane, trajectory server, staleness manager,
coordinator and reward stage in one process over instances with the real embedded
engine (the micro model; nucleus sampling keeps the untrained model from its EOS, so
every response runs to ``--response-tokens``; one decode step takes ``--step-ms``, a
large model's pace), kills one instance after a seeded number of engine steps (its
engine raises, as a crashed one does), and counts, for every
trajectory that was on it: the tokens it had generated (in flight), the tokens the TS
kept, and so the tokens to generate again. Rounds are side by side for each progress
interval (0 = no reports).

    python experiments/recovery_cost.py --json results/recovery_cost.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from coordinator import CoordinatorConfig
from parameter_server.torch_compat import state_dict_to_numpy
from staleflow.config import RewardConfig
from staleflow.data import ArithmeticConfig, PromptSampler, synthetic_dataset
from staleflow.engines import engine_class
from staleflow.engines.embedded import EmbeddedEngineConfig
from staleflow.models.build import build_arithmetic_model
from staleflow.models.state import policy_state
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.in_process import Serialized
from staleflow.runtime.workers.instance_host import InstanceHost
from staleflow.runtime.workers.specs import RewardSpec, build_reward_stage, tokenizer_spec
from staleness import StalenessConfig
from trajectory_server import TrajectoryServer, TrajectoryServerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--progress",
        default="0,1.0,0.25,0.1",
        help="progress-report intervals to compare, seconds (0 = never)",
    )
    p.add_argument("--rounds", type=int, default=3, help="kills per interval")
    p.add_argument("--response-tokens", type=int, default=96, help="tokens per response")
    p.add_argument(
        "--step-ms", type=float, default=20.0, help="one decode step of an instance at least"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


class StaticWeights:
    """The PS of a run that never trains: version 0 only."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self._weights = weights

    def fetch(self, at_least: int) -> tuple[int, Mapping[str, np.ndarray]]:
        return 0, self._weights


class Paced:
    """The real engine, one decode step every ``step_s`` at the most (a large model's
    pace: the micro model alone would finish a response between two reports), crashing
    on its ``die_at``-th step when given one."""

    def __init__(self, engine: Any, step_s: float, die_at: int | None = None) -> None:
        self._engine, self._step_s, self.die_at, self.steps = engine, step_s, die_at, 0
        self.died = threading.Event()

    def step(self) -> Any:
        self.steps += 1
        if self.die_at is not None and self.steps >= self.die_at:
            self.died.set()
            raise RuntimeError("engine crashed (experiment)")
        started = time.perf_counter()
        out = self._engine.step()
        time.sleep(max(0.0, self._step_s - (time.perf_counter() - started)))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def one_kill(progress_s: float, die_at: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    model, tokenizer = build_arithmetic_model("micro", seed=seed)
    weights = state_dict_to_numpy(policy_state(model))
    dataset = synthetic_dataset(tokenizer, ArithmeticConfig.level(1, seed=seed), size=2000)
    eta, batch, group = 1, 4, 4
    ts = Serialized(
        TrajectoryServer(
            TrajectoryServerConfig(eta, batch, group), PromptSampler(dataset, seed=seed)
        )
    )
    engines = []
    for i in range(2):
        m, _ = build_arithmetic_model("micro", seed=seed)
        config = EmbeddedEngineConfig(
            kv_budget_tokens=8192,
            max_running=16,
            max_seq_len=128,
            temperature=1.0,
            top_p=0.05,
            eos_token_id=tokenizer.eos_id,
            seed=seed + i,
        )
        engines.append(engine_class("embedded")(m, config))
    victim = Paced(engines[0], args.step_ms / 1e3, die_at)
    other = Paced(engines[1], args.step_ms / 1e3)
    box: list[ControlPlane] = []
    reward = build_reward_stage(
        RewardSpec(RewardConfig(kind="arithmetic"), tokenizer_spec(tokenizer)),
        ts,
        lambda records: box[0].rewarded(records),
    )
    lock = threading.Lock()

    def on_finished(finished: list[Any]) -> None:
        with lock:
            reward.process(finished)

    hosts = {
        i: InstanceHost(
            i,
            victim if i == 0 else other,
            ts=ts,
            weights=StaticWeights(weights),
            max_response=args.response_tokens,
            on_finished=on_finished,
            holder=f"{i}.0",
        )
        for i in range(2)
    }
    pool = ThreadPoolExecutor(4)
    control = ControlPlane(
        ControlConfig(
            StalenessConfig(eta=eta, batch_size=batch, group_size=group),
            CoordinatorConfig(period_s=0.02, migration="vanilla"),
            idle_wait_s=0.005,
        ),
        ts=ts,
        instances=hosts,
        holders={i: h.holder for i, h in hosts.items()},
        ps_version=lambda: 0,
        run_round=lambda actions: list(pool.map(lambda a: a(), actions)),
    )
    box.append(control)
    for h in hosts.values():
        h.start(0, progress_s)
    control.start()
    try:
        if not victim.died.wait(600):
            raise RuntimeError("the instance never reached its step of death")
        on_it = {tid: len(o.tokens) for tid, o in engines[0].progress().items()}
        deadline = time.monotonic() + 60
        while 0 in control.members:
            if time.monotonic() > deadline:
                raise RuntimeError("the control plane did not notice the lost instance")
            time.sleep(0.01)
        control.stop()  # nothing moves any more: count
        kept_by_ts = {t.traj_id: t.tokens for t in ts.ledger() if t.traj_id in on_it}
    finally:
        control.stop()
        for h in hosts.values():
            h.stop()
        pool.shutdown()
    in_flight = sum(on_it.values())
    kept = sum(kept_by_ts.get(t, 0) for t in on_it)
    return {
        "progress_s": progress_s,
        "die_at_step": die_at,
        "trajectories": len(on_it),
        "tokens_in_flight": in_flight,
        "tokens_kept": kept,
        "tokens_regenerated": in_flight - kept,
        "reports": hosts[0].progress_reports,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # the kill is on purpose: no tracebacks
    intervals = [float(v) for v in args.progress.split(",") if v.strip()]
    rng = random.Random(args.seed)
    kills = [
        rng.randint(args.response_tokens // 3, args.response_tokens) for _ in range(args.rounds)
    ]
    rows = []
    for progress_s in intervals:
        for k, die_at in enumerate(kills):
            rows.append(one_kill(progress_s, die_at, args, args.seed + k))
    print(
        f"{'reports every':>14} {'kills':>5} {'in flight':>10} {'kept':>8} "
        f"{'regenerated':>12} {'share':>6} {'from prompt':>12}"
    )
    summary = []
    for progress_s in intervals:
        mine = [r for r in rows if r["progress_s"] == progress_s]
        flight = sum(r["tokens_in_flight"] for r in mine)
        regen = sum(r["tokens_regenerated"] for r in mine)
        assert all(0 <= r["tokens_regenerated"] <= r["tokens_in_flight"] for r in mine), mine
        label = "never" if progress_s == 0 else f"{progress_s:g} s"
        share = regen / flight if flight else 0.0
        print(
            f"{label:>14} {len(mine):>5} {flight:>10} {flight - regen:>8} {regen:>12} "
            f"{share:>6.0%} {flight:>12}"
        )
        summary.append(
            {
                "progress_s": progress_s,
                "kills": len(mine),
                "tokens_in_flight": flight,
                "tokens_regenerated": regen,
                "regenerated_share": share,
            }
        )
    print(
        "regenerated <= in flight for every kill; 'from prompt' is what a system that "
        "restarts lost work from the prompt would generate again"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
                    "rows": rows,
                    "summary": summary,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
