"""The supervised warm-up, sampling-based accuracy, and the on-disk warm-up cache."""

from __future__ import annotations

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from staleflow.data.synthetic import ArithmeticConfig, ArithmeticTask, Problem  # noqa: E402
from staleflow.models import build_arithmetic_model, policy_state  # noqa: E402
from staleflow.models import threads as threads_module  # noqa: E402
from staleflow.models import warmup as warmup_module  # noqa: E402
from staleflow.models.sampling import evaluate_accuracy  # noqa: E402
from staleflow.models.threads import idle_cores  # noqa: E402
from staleflow.models.warmup import (  # noqa: E402
    DEFAULT_PRESET,
    META_FILE,
    _collate,
    default_cache_dir,
    default_task_config,
    ensure_warm_checkpoint,
    ensure_warm_model,
    warmup,
)
from staleflow.progress import PhaseState, Progress  # noqa: E402

LEVEL1 = ArithmeticConfig.level(1)


def test_collate_puts_the_loss_on_the_response_and_eos_only():
    _, tokenizer = build_arithmetic_model("micro")
    problems = [Problem(0, "1+2*3=", "7"), Problem(1, "5+4=", "9")]
    ids, labels, n = _collate(problems, tokenizer)
    first = tokenizer.decode(ids[0].tolist(), skip_special=False)
    assert first == "<bos>1+2*3=1+6=7<eos>"
    # position t is labelled with token t + 1: the response starts after "<bos>1+2*3="
    assert labels[0, :6].tolist() == [-100] * 6
    assert tokenizer.decode(labels[0, 6:12].tolist(), skip_special=False) == "1+6=7<eos>"
    assert labels[0, 12] == -100
    assert tokenizer.decode(labels[1, 4:6].tolist(), skip_special=False) == "9<eos>"
    assert (labels[1, 6:] == -100).all()
    assert (ids[1, 7:] == tokenizer.pad_id).all()
    assert n == 6 + 2


def _warm_micro(seed=0, steps=15):
    model, tokenizer = build_arithmetic_model("micro", seed=seed)
    stats = warmup(
        model, tokenizer, ArithmeticTask(LEVEL1), steps=steps, batch_size=16, lr=1e-2, seed=seed
    )
    return model, tokenizer, stats


def test_warmup_lowers_the_loss_and_is_deterministic():
    a, _, stats = _warm_micro()
    b, _, stats_b = _warm_micro()
    assert stats.final_loss < 0.75 * stats.first_loss
    assert stats.examples == 15 * 16 and stats.target_tokens > stats.examples
    assert (stats.first_loss, stats.final_loss) == (stats_b.first_loss, stats_b.final_loss)
    sa, sb = policy_state(a), policy_state(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c, _, _ = _warm_micro(seed=1)
    assert not torch.equal(policy_state(c)["model.norm.weight"], sa["model.norm.weight"])


def test_warmup_rejects_bad_settings():
    model, tokenizer = build_arithmetic_model("micro")
    with pytest.raises(ValueError, match="steps=0"):
        warmup(model, tokenizer, ArithmeticTask(LEVEL1), steps=0)
    with pytest.raises(ValueError, match="lr"):
        warmup(model, tokenizer, ArithmeticTask(LEVEL1), steps=1, lr=0.0)


def test_ensure_warm_checkpoint_builds_once_then_reuses(tmp_path, monkeypatch):
    kwargs = dict(steps=3, batch_size=8, lr=1e-2, cache_dir=tmp_path, eval_problems=8)
    path = ensure_warm_checkpoint("micro", LEVEL1, **kwargs)
    meta = json.loads((path / META_FILE).read_text())
    assert meta["key"]["task"]["max_digits"] == 1 and meta["key"]["steps"] == 3
    assert "torch" in meta["key"] and "transformers" in meta["key"]
    assert 0.0 <= meta["accuracy_t1"] <= 1.0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary leftovers

    def fail(*args, **kwargs):
        raise AssertionError("the cache was not used")

    monkeypatch.setattr(warmup_module, "warmup", fail)
    assert ensure_warm_checkpoint("micro", LEVEL1, **kwargs) == path
    model, tokenizer = ensure_warm_model("micro", LEVEL1, **kwargs)
    assert tokenizer.vocab_size == model.config.vocab_size == 17
    # anything that changes the result changes the entry
    with pytest.raises(AssertionError, match="cache was not used"):
        ensure_warm_checkpoint("micro", LEVEL1, **{**kwargs, "seed": 1})
    with pytest.raises(AssertionError, match="cache was not used"):
        ensure_warm_checkpoint("micro", ArithmeticConfig.level(2), **kwargs)


def test_ensure_warm_checkpoint_loads_the_same_weights_it_trained(tmp_path):
    kwargs = dict(steps=2, batch_size=4, lr=1e-2, seed=4, cache_dir=tmp_path, eval_problems=0)
    model, _ = ensure_warm_model("micro", LEVEL1, **kwargs)
    fresh, tokenizer = build_arithmetic_model("micro", seed=4)
    warmup(fresh, tokenizer, ArithmeticTask(LEVEL1), steps=2, batch_size=4, lr=1e-2, seed=4)
    a, b = policy_state(model), policy_state(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_warmup_stops_when_asked_and_reports_the_steps_it_ran():
    model, tokenizer = build_arithmetic_model("micro")
    asked: list[int] = []

    def stop(step: int) -> bool:
        asked.append(step)
        return step >= 4

    stats = warmup(
        model, tokenizer, ArithmeticTask(LEVEL1), steps=10, batch_size=4, stop=stop, check_every=2
    )
    assert asked == [2, 4]
    assert (stats.steps, stats.examples) == (4, 16)


def test_a_target_accuracy_stops_the_warm_up_and_keys_the_cache(tmp_path, monkeypatch):
    # validation accuracy rises 0.1 per check (every CHECK_EVERY steps): 0.1, 0.2, 0.3, ...
    calls = iter(range(1, 100))
    monkeypatch.setattr(
        warmup_module, "evaluate_accuracy", lambda *a, **k: round(0.1 * next(calls), 3)
    )
    monkeypatch.setattr(warmup_module, "CHECK_EVERY", 3)  # checks 3 steps apart, not 25
    every = warmup_module.CHECK_EVERY
    kwargs = dict(steps=10 * every, batch_size=2, lr=1e-2, cache_dir=tmp_path, eval_problems=0)
    path = ensure_warm_checkpoint("micro", LEVEL1, target_accuracy=0.3, **kwargs)
    meta = json.loads((path / META_FILE).read_text())
    assert meta["stats"]["steps"] == 3 * every  # stopped at the first check >= 0.3
    assert meta["validation"] == [[every, 0.1], [2 * every, 0.2], [3 * every, 0.3]]
    assert meta["key"]["target_accuracy"] == 0.3
    # without a target (or with another) it is another cache entry
    other = ensure_warm_checkpoint("micro", LEVEL1, target_accuracy=0.5, **kwargs)
    assert other != path
    with pytest.raises(ValueError, match=r"target_accuracy=1\.5"):
        ensure_warm_checkpoint("micro", LEVEL1, target_accuracy=1.5, **kwargs)


def test_cache_dir_follows_staleflow_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("STALEFLOW_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "warmup"
    monkeypatch.delenv("STALEFLOW_CACHE")
    assert default_cache_dir().parts[-3:] == (".cache", "staleflow", "warmup")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # minutes of CPU, more on a shared machine
@pytest.mark.parametrize("seed", [0, 1])
def test_default_warmup_leaves_room_for_rl(tmp_path, request, seed):
    """The warm-up staleflow launch runs by default (model.warmup_steps and
    model.warmup_target): a few minutes on 2 cores, and a policy that succeeds sometimes
    but not always (the starting point of RL), whatever the seed."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("minutes of CPU: run with -m slow")
    from staleflow.config.sections import ModelConfig

    defaults = ModelConfig()
    start = time.perf_counter()
    # one thread: on a shared machine a second one mostly waits (10x slower measured)
    model, tokenizer = ensure_warm_model(
        DEFAULT_PRESET,
        steps=defaults.warmup_steps,
        target_accuracy=defaults.warmup_target,
        seed=seed,
        cache_dir=tmp_path,
        eval_problems=0,
        num_threads=1,
    )
    seconds = time.perf_counter() - start
    held_out = ArithmeticTask(default_task_config(seed=99))
    accuracy = evaluate_accuracy(model, tokenizer, held_out, n=512, temperature=1.0)
    greedy = evaluate_accuracy(model, tokenizer, held_out, n=512, temperature=0.0)
    print(f"seed {seed}: warm-up {seconds:.0f}s, accuracy T=1 {accuracy:.3f}, greedy {greedy:.3f}")
    assert 0.15 <= accuracy <= 0.60
    assert greedy >= accuracy - 0.05


class _Phases:
    """Keeps every state a Progress reports."""

    def __init__(self) -> None:
        self.states: list[tuple[str, PhaseState]] = []

    def started(self, state: PhaseState) -> None:
        self.states.append(("started", state))

    def updated(self, state: PhaseState) -> None:
        self.states.append(("updated", state))

    def finished(self, state: PhaseState) -> None:
        self.states.append(("finished", state))


def test_the_warm_up_reports_steps_loss_accuracy_and_its_target(tmp_path, monkeypatch):
    calls = iter([0.05, 0.5])  # the second check reaches the target
    monkeypatch.setattr(warmup_module, "evaluate_accuracy", lambda *a, **k: next(calls))
    every = warmup_module.CHECK_EVERY
    seen = _Phases()
    kwargs = dict(steps=10 * every, batch_size=2, lr=1e-2, cache_dir=tmp_path, eval_problems=0)
    ensure_warm_checkpoint("micro", LEVEL1, target_accuracy=0.3, progress=Progress(seen), **kwargs)
    kinds = [kind for kind, _ in seen.states]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    first = seen.states[0][1]
    assert (first.key, first.total, first.unit) == ("warmup", 10 * every, "steps")
    assert first.upper_bound and first.goal == "accuracy 30%"
    updates = [s for kind, s in seen.states if kind == "updated"]
    steps = [s.done for s in updates]
    assert steps == sorted(steps) and steps[-1] == 2 * every  # every step, to the stop
    assert all(s.metrics["loss"] > 0 for s in updates)
    assert [s.metrics.get("accuracy") for s in updates if s.done == every][-1] == 0.05
    last = seen.states[-1][1]
    assert last.metrics["accuracy"] == 0.5 and not last.failed
    assert f"stopped at step {2 * every}" in last.note
    # a cache hit has nothing to wait for: no phase at all
    again = _Phases()
    ensure_warm_checkpoint("micro", LEVEL1, target_accuracy=0.3, progress=Progress(again), **kwargs)
    assert again.states == []


def _machine(monkeypatch, readings):
    """Fake /proc/stat, process CPU time and wall clock, one tuple per reading:
    (idle jiffies, total jiffies, own CPU seconds, wall seconds) on 2 CPUs."""
    readings = iter(readings)
    current = {}

    def cpu_times():
        current.update(zip(("idle", "total", "own", "wall"), next(readings), strict=True))
        return current["idle"], current["total"]

    monkeypatch.setattr(threads_module, "_cpu_times", cpu_times)
    monkeypatch.setattr(threads_module.time, "process_time", lambda: current["own"])
    monkeypatch.setattr(threads_module.time, "monotonic", lambda: current["wall"])
    monkeypatch.setattr(threads_module.time, "sleep", lambda s: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


@pytest.mark.parametrize(("idle_share", "threads"), [(1.0, 2), (0.8, 2), (0.6, 1), (0.0, 1)])
def test_the_warm_up_starts_on_the_cores_idle_now(monkeypatch, idle_share, threads):
    # over one second, idle_share of the two CPUs' time was idle; this process slept
    _machine(monkeypatch, [(0.0, 0.0, 5.0, 0.0), (200.0 * idle_share, 200.0, 5.0, 1.0)])
    assert idle_cores() == threads


def test_free_cores_count_only_what_other_processes_use(monkeypatch):
    _machine(
        monkeypatch,
        [
            (0, 0, 0.0, 0.0),
            (0, 200, 2.0, 1.0),  # both CPUs busy, all of it this process: 2 free
            (0, 400, 3.0, 2.0),  # both busy, this process used 1: another job holds 1
            (100, 600, 4.0, 3.0),  # half idle, this process used 1: the other job left
        ],
    )
    free = threads_module.FreeCores()
    assert [free(), free(), free()] == [2, 1, 2]


@pytest.mark.parametrize(("load", "threads"), [(0.0, 2), (0.4, 2), (1.0, 1), (7.5, 1)])
def test_without_proc_stat_the_load_average_decides(monkeypatch, load, threads):
    monkeypatch.setattr(threads_module, "_cpu_times", lambda: None)
    monkeypatch.setattr(threads_module.time, "sleep", lambda s: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert idle_cores() == threads


def test_the_warm_up_follows_the_free_cores_as_other_jobs_come(tmp_path, monkeypatch):
    free = iter([1, 2])  # at step CHECK_EVERY another job holds a core; later it is gone

    class Share:
        def __call__(self):
            return next(free)

    monkeypatch.setattr(warmup_module, "idle_cores", lambda: 2)
    monkeypatch.setattr(warmup_module, "FreeCores", Share)
    monkeypatch.setattr(warmup_module, "CHECK_EVERY", 3)  # 6 steps, not 50
    every = warmup_module.CHECK_EVERY
    seen = _Phases()
    ensure_warm_checkpoint(
        "micro",
        LEVEL1,
        steps=2 * every,
        batch_size=2,
        lr=1e-2,
        cache_dir=tmp_path,
        eval_problems=0,
        progress=Progress(seen),
    )
    details = {s.done: s.detail for kind, s in seen.states if kind == "updated"}
    assert details[1] == "2 threads" and details[every - 1] == "2 threads"
    assert details[every] == "1 thread" and details[2 * every - 1] == "1 thread"
    assert details[2 * every] == "2 threads"


def test_cpu_times_read_this_machine():
    times = threads_module._cpu_times()
    if times is not None:  # Linux
        idle, total = times
        assert 0 <= idle <= total and total > 0


def test_the_threads_benchmark_prints_a_row_per_setting(tmp_path, capsys, monkeypatch):
    import sys

    from tests.support.experiments import load

    bench = load("bench_warmup")
    monkeypatch.setattr(
        bench, "build_arithmetic_model", lambda *a, **k: build_arithmetic_model("micro")
    )
    out = tmp_path / "bench.json"
    monkeypatch.setattr(
        sys, "argv", ["bench_warmup", "--rounds", "1", "--steps", "1", "--json", str(out)]
    )
    assert bench.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert "1 thread" in rows and any(name.startswith("idle_cores()") for name in rows)
    assert all(r["median_s"] > 0 for r in rows.values())
    assert "s/step (median)" in capsys.readouterr().out
