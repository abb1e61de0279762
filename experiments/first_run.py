"""The first ten minutes of a new user, measured: a fresh clone, then the README's two
commands.

``run``: ``scripts/run`` in a fresh clone of this checkout (its committed HEAD) with an
empty warm-up cache, output read as a log. Breakdown of the time to the first training
step: the install (``scripts/setup``), the launcher's start, the warm-up, the initial
scoring, the actor start-up and the first buffer, each as the launcher reports it; then
checks that the dashboard it prints serves ``/api/overview``, and stops the run (``--full``
lets it finish).

``check``: ``scripts/check`` in a fresh clone: the time of each stage, the total, and
every test pytest skipped, with its reason (``--stages lint tests``: only those; the
``vllm`` stage alone installs vLLM for about a quarter of an hour).

Installs go through pip as the scripts do: pip's own cache (or a local index) is what
makes a "warm package cache". The load average is printed with the figures, since other
work on the machine stretches every phase.

    python experiments/first_run.py                       # run, then check
    python experiments/first_run.py --what run --json results/first_run.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The launcher's plain progress lines (staleflow.progress.PlainLines): "<label> ... (...)"
# when a phase starts, "<label>: done in ..." when it ends.
START = re.compile(r"^(?P<label>.+?) \.\.\.(?: \(.*\))?$")
END = re.compile(r"^(?P<label>.+?): (?P<how>done|failed) in ")
PHASES = {  # label prefix -> name in the table
    "warming up the built-in": "warm-up",
    "scoring the initial policy": "initial scoring",
    "starting actors": "actor start-up",
    "waiting for the first buffer": "first buffer",
}


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"


def fresh_clone(workdir: Path) -> Path:
    clone = workdir / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    return clone


def _env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["STALEFLOW_CACHE"] = str(workdir / "cache")  # empty: the first run warms up
    env.pop("STALEFLOW_VENV", None)
    return env


def measure_run(clone: Path, workdir: Path, full: bool, stop_timeout_s: float) -> dict[str, Any]:
    start = time.monotonic()
    proc = subprocess.Popen(
        ["scripts/run", f"run_dir={workdir / 'runs'}"],
        cwd=clone,
        env=_env(workdir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: stopped as a whole
        # Ctrl-C semantics even when this script runs in the background (where SIGINT
        # is ignored, and Python would then never raise KeyboardInterrupt)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    marks: dict[str, float] = {}
    spans: dict[str, list[float]] = {}
    dashboard: dict[str, Any] = {"url": None, "served": False}
    assert proc.stdout is not None
    for raw in proc.stdout:
        now = time.monotonic() - start
        line = raw.rstrip("\n")
        print(f"{now:7.1f}s  {line}", flush=True)
        if line.startswith("setup: installing") or line.startswith("setup: creating"):
            marks.setdefault("install_start", now)
        elif line == "setup: done":
            marks["install_end"] = now
        elif line.startswith("placed on "):  # Ray started, the placement plan fitted
            marks.setdefault("launch_start", now)
        elif line.startswith("dashboard at ") and dashboard["url"] is None:
            dashboard["url"] = line.split()[-1]
            dashboard["served"] = _serves(dashboard["url"])
        elif line.startswith("step ") and "first_step" not in marks:
            marks["first_step"] = now
            if not full:
                os.killpg(proc.pid, signal.SIGINT)  # the launcher tears its actors down
        for pattern, key in ((START, 0), (END, 1)):
            m = pattern.match(line)
            if m:
                for prefix, name in PHASES.items():
                    if m.group("label").startswith(prefix):
                        spans.setdefault(name, [now, now])[key] = now
    try:
        code = proc.wait(timeout=stop_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    return {
        "marks": marks,
        "phases": {k: round(v[1] - v[0], 1) for k, v in spans.items()},
        "dashboard": dashboard,
        "exit_code": code,
    }


def _serves(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "api/overview", timeout=30) as r:
            return r.status == 200 and "run" in json.load(r)
    except OSError:
        return False


def measure_check(clone: Path, workdir: Path, stages: list[str]) -> dict[str, Any]:
    start = time.monotonic()
    done = subprocess.run(
        ["scripts/check", *stages],
        cwd=clone,
        env=_env(workdir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seconds = time.monotonic() - start
    out = done.stdout
    summary = out.rsplit("== summary\n", 1)[-1].splitlines() if "== summary" in out else []
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    return {
        "seconds": round(seconds, 1),
        "exit_code": done.returncode,
        "stages": summary,
        "skipped": skipped,
        "tail": out.splitlines()[-40:],
    }


def print_run(result: dict[str, Any]) -> None:
    marks = result["marks"]
    rows = []
    if "install_start" in marks and "install_end" in marks:
        rows.append(("install (scripts/setup)", marks["install_end"] - marks["install_start"]))
    if "launch_start" in marks:
        begun = marks.get("install_end", 0.0)
        rows.append(("launcher start (imports, Ray, placement)", marks["launch_start"] - begun))
    rows += list(result["phases"].items())
    print(f"\n{'phase':<40} {'seconds':>8}")
    for name, seconds in rows:
        print(f"{name:<40} {seconds:>8.1f}")
    first = marks.get("first_step")
    print(f"{'time to the first training step':<40} {first if first else float('nan'):>8.1f}")
    d = result["dashboard"]
    print(f"dashboard: {d['url']} served /api/overview: {d['served']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=["run", "check", "both"], default="both")
    parser.add_argument("--full", action="store_true", help="let scripts/run finish its steps")
    parser.add_argument("--workdir", help="where the clone goes (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the clone and its .venv")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--stop-timeout", type=float, default=600.0)
    parser.add_argument(
        "--stages", nargs="*", default=[], help="scripts/check's stages to run (default: all)"
    )
    args = parser.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="staleflow-first-run-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"load_before": load(), "head": _head()}
    try:
        if args.what in ("run", "both"):
            clone = fresh_clone(workdir / "run")
            out["run"] = measure_run(clone, workdir / "run", args.full, args.stop_timeout)
            out["run"]["load_after"] = load()
            print_run(out["run"])
        if args.what in ("check", "both"):
            clone = fresh_clone(workdir / "check")
            out["check"] = measure_check(clone, workdir / "check", args.stages)
            out["check"]["load_after"] = load()
            print(
                f"\nscripts/check: exit {out['check']['exit_code']} in {out['check']['seconds']}s"
            )
            print("\n".join(out["check"]["stages"]))
            print(f"skipped ({len(out['check']['skipped'])}):")
            print("\n".join(out["check"]["skipped"]) or "  none")
    finally:
        print(f"load average (1/5/15 min): before {out['load_before']}, now {load()}")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = out.get("run", {}).get("exit_code") not in (None, 0, -signal.SIGINT, 130)
    failed |= out.get("check", {}).get("exit_code", 0) != 0
    return 1 if failed else 0


def _head() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
