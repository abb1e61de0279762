"""What an instance's sibling fetch (grouped drafts across instances, docs/speculation.md)
costs the trajectory server: one ``group_responses`` call through the bytes service (the
request packed, served, the reply packed and unpacked, as over the Ray actor but without
its round trip), in process.

Every member of ``--groups`` groups of ``--group-size`` runs on another instance and has
reported ``--tokens`` tokens; the fetching instance asks for all of those groups. Three
calls: the first (every response whole), one after each member grew by ``--grow`` tokens
(only those travel), and one with nothing new. Figures: milliseconds of CPU per call (the
minimum of ``--repeats``: a shared machine's load only adds), bytes each way, tokens sent.

    python experiments/bench_sibling_fetch.py --json results/bench_sibling_fetch.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from trajectory_server import PartialTrajectory, SiblingResponses, TrajectoryServerConfig, wire
from trajectory_server.actor import TrajectoryServerService


class _Prompts:
    def __init__(self) -> None:
        self.drawn = 0

    def next_sample(self) -> object:
        i, self.drawn = self.drawn, self.drawn + 1
        prompt = np.arange(32, dtype=np.int32) + i
        return type("Sample", (), {"sample_id": i, "prompt_ids": prompt, "answer": ""})()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups", type=int, default=64, help="groups asked for (default 64)")
    p.add_argument("--group-size", type=int, default=8, help="members per group (default 8)")
    p.add_argument("--tokens", type=int, default=256, help="tokens each member has (256)")
    p.add_argument("--grow", type=int, default=16, help="tokens each member adds (16)")
    p.add_argument("--repeats", type=int, default=5, help="calls per figure (default 5)")
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # eta 1: the TS holds 2 x batch groups; ask for the first --groups of them
    batch = -(-args.groups // 2)
    config = TrajectoryServerConfig(eta=1, batch_size=batch, group_size=args.group_size)
    service = TrajectoryServerService(config, _Prompts())
    ts = service._ts
    ids = [t for g in range(args.groups) for t in ts.group_members(g)]
    ts.route(ids, 0, "elsewhere")

    def report(n: int) -> None:
        tokens, zeros = np.arange(n, dtype=np.int32) % 1000, np.zeros(n, np.float32)
        partials = [PartialTrajectory(t, tokens, zeros, np.zeros(n, np.int32)) for t in ids]
        ts.report_progress(partials, "elsewhere")

    known: dict[int, dict[int, int]] = {g: {} for g in range(args.groups)}
    rows = []

    def measure(name: str) -> None:
        request = wire.pack(wire.SiblingRequest(known, "here", ()))
        best = float("inf")
        for _ in range(args.repeats):
            started = time.process_time()
            reply = service.group_responses(request)
            out = wire.unpack(reply, SiblingResponses)
            best = min(best, time.process_time() - started)
        for r in out.responses:
            known[r.group_id][r.traj_id] = r.start + len(r.tokens)
        rows.append(
            {
                "call": name,
                "cpu_ms": best * 1e3,
                "request_bytes": len(request),
                "reply_bytes": len(reply),
                "pieces": len(out.responses),
                "tokens": sum(len(r.tokens) for r in out.responses),
            }
        )

    report(args.tokens)
    measure("first (whole responses)")
    report(args.tokens + args.grow)
    measure(f"+{args.grow} tokens per member")
    measure("nothing new")
    result = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
    for r in rows:
        print(
            f"{r['call']:>26}: {r['cpu_ms']:7.2f} ms CPU, {r['request_bytes']:>7} B asked, "
            f"{r['reply_bytes']:>8} B back, {r['pieces']:>5} pieces, {r['tokens']:>7} tokens"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
