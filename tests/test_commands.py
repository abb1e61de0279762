"""The README's two commands are the ones CI and the docs use: `scripts/run` (set up, then
`staleflow launch --eta 3`) and `scripts/check` (set up, then every check CI runs). CI
calls `scripts/check` itself, and the default test selection is written in one place, so
what a newcomer runs and what CI checks cannot drift apart again."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SELECTION = "not gpu and not slow and not browser"


def readme_commands() -> list[str]:
    """The commands of the first code block under "Set up and run", comments dropped."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up and run", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md: no bash block under 'Set up and run'"
    lines = (line.split("#", 1)[0].strip() for line in block.group(1).splitlines())
    return [line for line in lines if line]


def test_the_readme_gives_two_commands_one_runs_the_job_one_checks():
    assert readme_commands() == ["scripts/run", "scripts/check"]
    for name in ("run", "check", "setup"):
        assert os.access(ROOT / "scripts" / name, os.X_OK), f"scripts/{name} is not executable"
    run = (ROOT / "scripts" / "run").read_text()
    setup = run.index('\n"$root/scripts/setup"\n')  # sets up what is missing first
    launch = re.search(r'^exec "\S+/bin/staleflow" launch --eta 3 "\$@"$', run, re.M)
    assert launch and launch.start() > setup, run


def test_ci_runs_the_readmes_check_command_and_nothing_else_tests():
    text = (ROOT / ".ci" / "run").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[-1] == "exec scripts/check", "CI must end by running the README's check"
    assert "pytest" not in text and "ruff" not in text, "a check in .ci/run bypasses the README"


def test_the_check_command_sets_up_lints_tests_vllm_and_drives_the_browser():
    check = (ROOT / "scripts" / "check").read_text()
    stages = re.findall(r"^stage (\S+) ", check, re.M)
    assert stages == ["lint", "tests", "vllm", "sglang", "envs", "browser"]
    # each engine's tests in their own environment, built in the background (prepare)
    # while lint and tests run, then tested by its stage
    for engine in ("vllm", "sglang"):
        assert re.search(rf"^stage {engine} engine_stage {engine}\b", check, re.M)
    assert 'bash ".ci/$engine" prepare' in check and 'bash ".ci/$name" test' in check
    assert os.access(ROOT / ".ci" / "vllm", os.R_OK)
    listed = re.search(r"^stages=\((.*?)\)", check, re.M)
    assert listed and listed.group(1).split() == stages  # what --help and the check name
    assert '"$root/scripts/setup" dev' in check
    # the envs extra is installed in the background after the tests stage, which must not
    # see it arrive mid-run, and its stage fails rather than skips without it
    assert check.index("stage tests tests\nenvs_install\n") < check.index("stage envs envs")
    assert 'python -c "import verifiers.v1" || return 1' in check
    assert "ruff check . && ruff format --check ." in check
    assert f'-m "{SELECTION}"' in check


def test_the_check_command_names_its_stages_before_setting_anything_up(tmp_path):
    env = {**os.environ, "STALEFLOW_VENV": str(tmp_path / "venv")}
    check = str(ROOT / "scripts" / "check")
    shown = subprocess.run([check, "--help"], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "stages: lint tests vllm sglang envs browser" in shown.stderr
    wrong = subprocess.run([check, "test"], env=env, capture_output=True, text=True)
    assert wrong.returncode != 0 and "no stage 'test'" in wrong.stderr
    assert not (tmp_path / "venv").exists()  # neither call set anything up


def test_the_default_test_selection_is_written_once():
    # README, docs and CI point at scripts/check rather than repeat its pytest line
    texts = [ROOT / "README.md", ROOT / ".ci" / "run", *(ROOT / "docs").glob("*.md")]
    for path in texts:
        assert SELECTION not in path.read_text(), f"{path.name} repeats scripts/check's selection"


def test_the_docs_name_the_readmes_commands():
    setup = (ROOT / "docs" / "setup.md").read_text()
    for command in readme_commands():
        assert f"`{command}`" in setup
    assert "scripts/setup" in setup


def test_setup_does_nothing_when_everything_is_installed(tmp_path):
    # a venv whose stamp says this pyproject/constraints and these extras are installed:
    # scripts/setup must return at once, without pip (there is no pip in this fake venv)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\necho 'pip was called' >&2\nexit 3\n")
    python.chmod(0o755)
    digest = subprocess.run(
        "cat pyproject.toml constraints.txt | sha256sum | cut -c1-16",
        shell=True,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (venv / ".staleflow-installed").write_text(f"{digest} -\n{digest} dev\n")
    env = {**os.environ, "STALEFLOW_VENV": str(venv)}
    for args in ([], ["dev"]):
        done = subprocess.run(
            [str(ROOT / "scripts" / "setup"), *args], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done
    # an extra not installed yet does call pip (the fake one fails, and so does setup)
    more = subprocess.run(
        [str(ROOT / "scripts" / "setup"), "browser"], env=env, capture_output=True, text=True
    )
    assert more.returncode != 0 and "pip was called" in more.stdout + more.stderr
    assert "staleflow (.[browser])" in more.stdout
