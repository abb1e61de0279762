"""The run plan: the launch configuration is resolved once, by the plan builder, and nothing
below it takes the whole ``RunConfig``.

The first tests read the library's source with :mod:`ast` (nothing is imported), as
``tests/staleflow/runtime/controller/test_control_clients.py`` does for raw ``.remote()``
calls: a function or method with a parameter annotated ``RunConfig`` must be one of the
few entry points listed in :data:`TAKES_THE_CONFIG`, and inside ``staleflow/runtime/`` only
the plan builder calls ``RunConfig.resolved()``. The others check what the plan holds
against the configuration it was built from. No Ray."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from staleflow.config import load_config
from staleflow.runtime.driver.run_plan import RunPlan, plan_run
from staleflow.runtime.errors import LaunchError
from staleflow.runtime.placement.plan import plan_placement
from staleflow.runtime.workers.specs import env_spec

ROOT = Path(__file__).resolve().parents[4]
LIBRARY = ROOT / "staleflow"
CONFIG_PACKAGE = LIBRARY / "config"  # where RunConfig is defined, read and written
PLAN_BUILDER = "staleflow/runtime/driver/run_plan.py"

# (module, qualified name) of every function allowed a RunConfig parameter, and why
TAKES_THE_CONFIG: dict[tuple[str, str], str] = {
    ("staleflow/runtime/driver/launch.py", "launch"): "the entry point: it builds the plan",
    ("staleflow/runtime/driver/launch.py", "check_placement"): "`launch --check`: builds it",
    (PLAN_BUILDER, "plan_run"): "the plan builder",
    (PLAN_BUILDER, "control_config"): "the plan builder's control-plane section",
    ("staleflow/runfolder/writer.py", "RunOutput.create"): "writes config.yaml whole",
    ("staleflow/runfolder/writer.py", "RunOutput.resume"): "writes config.yaml whole",
    # the CLI hands the dashboard the configuration it shows whole (config.yaml's keys)
    ("staleflow/dashboard/launch_hook.py", "start_dashboard"): "the CLI's dashboard",
    ("staleflow/dashboard/launch_hook.py", "LaunchDashboard.__init__"): "the CLI's dashboard",
    ("staleflow/dashboard/ray_source.py", "RaySource.from_run"): "the CLI's dashboard",
    ("staleflow/dashboard/runconfig.py", "cost_model_of"): "a saved config.yaml's cost model",
}


def _functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method of ``tree`` with its qualified name (``Class.method``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def takers(source: str) -> list[str]:
    """Qualified names of the functions of ``source`` with a parameter whose annotation
    names ``RunConfig`` (``RunConfig``, ``config.RunConfig``, ``RunConfig | None``...)."""
    found = []
    for name, fn in _functions(ast.parse(source)):
        a = fn.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
        if any(p.annotation is not None and _names_config(p.annotation) for p in params):
            found.append(name)
    return found


def _names_config(annotation: ast.expr) -> bool:
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "RunConfig":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "RunConfig":
            return True
        quoted = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if quoted and "RunConfig" in node.value:  # a quoted annotation
            return True
    return False


def _library() -> Iterator[tuple[str, str]]:
    for path in sorted(LIBRARY.rglob("*.py")):
        if CONFIG_PACKAGE in path.parents:
            continue
        yield str(path.relative_to(ROOT)), path.read_text()


def test_the_scan_finds_a_config_parameter_in_every_form():
    source = (
        "def a(cfg: RunConfig) -> None: ...\n"
        "def b(x: int, *, cfg: 'RunConfig | None' = None) -> None: ...\n"
        "class C:\n"
        "    def m(self, cfg: config.RunConfig) -> None:\n"
        "        def inner(c: RunConfig) -> None: ...\n"
        "def d(plan: RunPlan, model: ModelConfig) -> RunConfig: ...\n"  # returns it: fine
    )
    assert takers(source) == ["a", "b", "C.m", "C.m.inner"]


def test_nothing_below_the_plan_builder_takes_the_run_config():
    found = {(module, name) for module, source in _library() for name in takers(source)}
    extra = sorted(found - set(TAKES_THE_CONFIG))
    assert not extra, (
        "these functions take the whole RunConfig: give them the run plan's record or the "
        f"resolved section they read (staleflow/runtime/driver/run_plan.py): {extra}"
    )
    # the allow-list names only what is there (a renamed entry point leaves it)
    assert not set(TAKES_THE_CONFIG) - found, sorted(set(TAKES_THE_CONFIG) - found)


def test_only_the_plan_builder_resolves_the_config_in_the_runtime():
    calls = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted((LIBRARY / "runtime").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "resolved"
    ]
    assert [c.split(":")[0] for c in calls] == [PLAN_BUILDER], calls


# -- what the plan holds ---------------------------------------------------------------------


def _plan(*overrides: str) -> RunPlan:
    return plan_run(load_config(None, list(overrides)))


def test_the_plan_holds_the_resolved_sections():
    cfg = load_config(None, ["data.task=calculator", "trainer.advantage=drgrpo"])
    plan = plan_run(cfg)
    resolved = cfg.resolved()
    assert cfg.reward.kind == "auto" and plan.reward.kind == resolved.reward.kind == "exact"
    assert plan.rollout == resolved.rollout != cfg.rollout  # the episodes' response budget
    assert plan.trainer == resolved.trainer and cfg.trainer.loss_norm_len == 0
    assert plan.trainer.loss_norm_len == plan.rollout.max_response_tokens  # Dr. GRPO's constant
    assert plan.config == resolved  # what config.yaml and the trackers record
    assert plan.task.data == cfg.data and plan.task.seed == cfg.seed
    spec = plan.environment()
    assert spec == env_spec(cfg.env, "calculator", resolved.rollout.max_response_tokens)
    assert spec is not None and spec.max_tokens == plan.rollout.max_response_tokens
    assert plan_run(plan.config) == plan  # resolving a resolved config changes nothing


def test_an_unknown_environment_is_left_to_preflight_which_names_the_key():
    plan = _plan(
        "data.task=env", "env.name=no_such_env", "data.path=/d/rows.jsonl", "model.checkpoint=/m"
    )
    with pytest.raises(ValueError, match="unknown environment 'no_such_env'"):
        plan.environment()  # asked when the reward workers start, after preflight
    assert _plan().environment() is None  # a single-turn task


def test_the_control_plane_plans_with_the_engines_kv_budget_once():
    plan = _plan("coordinator.cost_model.kv_budget=null", "rollout.kv_budget_tokens=4096")
    assert plan.config.coordinator.cost_model.kv_budget is None  # as configured
    assert plan.control.coordinator.cost_model.kv_budget == 4096.0
    assert plan.control.staleness == plan.config.staleness_config()
    assert plan.control.sampling == plan.config.sampling_config()
    assert plan.trajectory_server == plan.config.trajectory_server_config()
    assert (plan.eta, plan.batch_size) == (plan.config.eta, plan.config.batch_size)


def test_the_placement_request_is_the_sections_plan_and_room_for_two_instances():
    cfg = load_config(None, ["rollout.instances=3", "address=auto", "reward.workers=2"])
    request = plan_run(cfg).placement
    assert request.plan == plan_placement(cfg.resources, cfg.rollout, cfg.trainer, cfg.reward)
    assert len(request.plan.pool("rollout")) == 3
    assert request.address == "auto"
    assert request.spare_cpus == 2 * cfg.rollout.tensor_parallel * cfg.resources.rollout.cpus


def test_a_backend_launch_cannot_build_is_refused_before_its_ranks_are_counted(monkeypatch):
    from staleflow.runtime import backends

    monkeypatch.delitem(backends.TRAINER_POOLS, "megatron")
    with pytest.raises(LaunchError, match=r"trainer\.backend=megatron is not implemented"):
        _plan("trainer.backend=megatron")
