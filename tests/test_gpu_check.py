"""`scripts/gpu-check` on a machine without a GPU: `--dry-run` lists every stage with its
limit (within the script's budget), a real run is refused with a message naming the fix
before anything is installed, and the stage runner reports a stage that overruns its
limit as `timeout` (killed, not waited for) and reads a probe's figures."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"


def _module():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


def test_dry_run_lists_every_stage_with_its_limit():
    gc = _module()
    shown = subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    limits = {}
    for line in shown.stdout.splitlines():
        words = line.split()
        if len(words) > 3 and words[1] == "limit":
            limits[words[0]] = int(words[2])
    assert list(limits) == ["setup", *(s.name for s in gc.STAGES), "total"]
    assert {"gpu-tests", "megatron", "vllm", "launch"} <= set(limits)
    assert sum(s.limit_s for s in gc.STAGES) == limits["total"] <= gc.BUDGET_S == 480


def test_a_real_run_without_a_gpu_is_refused_before_any_install(tmp_path):
    venv, out = tmp_path / "venv", tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "GPU_CHECK_SMI": str(tmp_path / "no-nvidia-smi")}
    refused = subprocess.run(
        [sys.executable, str(SCRIPT), "--venv", str(venv), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "no CUDA GPU" in refused.stderr and "--dry-run" in refused.stderr
    assert not venv.exists() and not out.exists()


def test_a_stage_past_its_limit_is_killed_and_reported_as_timeout(tmp_path):
    gc = _module()
    env = {"PATH": "/usr/bin:/bin"}
    slow = gc.Stage("slow", 1, "sleeps", (), ("-c", "import time; time.sleep(120)"))
    outcome = gc.run_stage(slow, sys.executable, tmp_path, env, left=60)
    assert outcome.status == "timeout" and outcome.seconds < 30
    assert "killed after 1 s" in outcome.detail
    # the budget caps a stage's own limit; a spent budget runs nothing
    spent = gc.run_stage(slow, sys.executable, tmp_path, env, left=0)
    assert spent.status == "not run"


def test_a_stage_reports_the_probes_figures_and_its_failure(tmp_path):
    gc = _module()
    env = {"PATH": "/usr/bin:/bin"}
    figures = {"mfu": 0.41, "push_s_per_gib": 0.2}
    line = f"print('log line'); print('{gc.RESULT} ' + {json.dumps(json.dumps(figures))})"
    ok = gc.run_stage(
        gc.Stage("megatron", 30, "", (), ("-c", line)), sys.executable, tmp_path, env, 60
    )
    assert ok.status == "passed" and ok.figures == figures
    bad = gc.Stage("vllm", 30, "", (), ("-c", "raise SystemExit('no engine')"))
    failed = gc.run_stage(bad, sys.executable, tmp_path, env, 60)
    assert failed.status == "failed" and "no engine" in failed.tail
    missing = gc.Stage("x", 30, "", ("no_such_module_here",), ("-c", "pass"))
    assert gc.run_stage(missing, sys.executable, tmp_path, env, 60).status == "missing"
    # on a GPU machine the gpu tests must run, not all skip
    skipped = gc.Stage("gpu-tests", 30, "", (), ("-c", "print('14 skipped in 3.0s')"))
    all_skipped = gc.run_stage(skipped, sys.executable, tmp_path, env, 60)
    assert all_skipped.status == "failed" and all_skipped.figures == {"skipped": 14}
    table = gc.table([gc.Outcome("setup", "passed"), ok, failed])
    assert "41.0%" in table and "0.200" in table and "failed" in table
