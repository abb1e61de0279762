"""Named simulated clusters and the systems compared in §6.

Every number of the paper preset is explained in ``docs/simulator.md``; the short form:

- cost model: Table 4 (Qwen3-30B-A3B, k1..k4), profiled per rollout instance; the
  coordinator's ``qwen3-30b-a3b-h20`` preset adds k5 = 1 KV token per token and
  M = 262,144 tokens for one H20 per instance.
- layout: 128 H20 GPUs (§6.1, §6.5). Table 4 describes one instance on one GPU (the model's
  ~61 GB of bf16 weights fit one 96 GB H20), so instances have one GPU each; the paper
  tunes the rollout/training split without reporting it; 64 rollout + 64 training GPUs
  gave StaleFlow the highest simulated throughput at eta = 3 of the splits 96/32, 80/48
  and 64/64 (experiments/log/simulator-2026-11-22-before-the-rules.md, "The GPU split is
  not it", has the figures), so it is the default.
- batch 128 x group 16 (§6.1), eta = 3 (§6.5), response cap 20K (§6.1/§6.4; §6.5 itself
  uses 40K, available with ``max_response=40_000``), prompts capped at 2K (§6.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from coordinator import CoordinatorConfig, CostModelConfig, FreshnessConfig
from staleflow.sim.agentic import AgenticConfig
from staleflow.sim.cluster import ClusterConfig
from staleflow.sim.engine import EngineCosts
from staleflow.sim.trainer import TrainerCosts
from staleflow.sim.truth import EngineTruth
from staleflow.sim.workload import WorkloadConfig

# Training FLOPs per token: forward + backward (6 x 3.3B active parameters) plus the
# old-policy log-prob forward (2 x 3.3B), i.e. ~2.6e10. One H20 delivers ~148 dense bf16
# TFLOP/s, of which we assume 25% (MoE training MFU) per training GPU.
_TRAIN_FLOPS_PER_TOKEN = 2.6e10
_TRAIN_FLOPS_PER_GPU = 148e12 * 0.25
# Training attention: causal attention costs 2 x 48 layers x 4096 (32 query heads x 128)
# FLOPs per token pair in a forward pass, i.e. 393,216 x L**2 for a sequence of L tokens;
# forward + backward (3x) plus the old-policy log-prob forward (1x) make 4x that, at the
# same MFU. At L = 7K (the mean) it adds ~40% to the linear layers' 2.6e10 per token; at
# the 20K cap it exceeds them.
_TRAIN_ATTENTION_FLOPS_PER_TOKEN_SQ = 4 * 2 * 48 * 4096
# Pull: ~61 GB of bf16 weights over PCIe DMA from the co-located PS replica (App. A.1) at
# ~25 GB/s, plus ~0.5 s of fixed latency. Push goes over RDMA and is overlapped anyway.
_PULL_S = 61.0 / 25.0 + 0.5
# Prefill of a prefix of L tokens: the linear layers cost 2 x 3.3B active parameters FLOPs per
# token, causal attention 2 x 48 layers x 4096 (32 query heads x 128) FLOPs per token pair,
# i.e. 6.6e9*L + 393,216*L**2 FLOPs, at a fraction PREFILL_MFU of an H20's 148 dense bf16
# TFLOP/s. PREFILL_MFU is the one number we calibrate: with 0.47 the simulated StaleFlow at
# the §6.5 setting (40K responses, eta = 3) spends ~7.9% of its rollout time in (re-)prefill,
# the share Table 3 measures (36.4 s of 460 s per step). (The preset used a flat 6e-5 s per
# token before, which its own comment derived from "15% of an H20" by an arithmetic slip:
# that MFU gives 3e-4; 6e-5 gave 2-3% prefill against Table 3's 7.9%.)
_H20_BF16_FLOPS = 148e12
_PREFILL_FLOPS_PER_TOKEN = 2 * 3.3e9
_ATTENTION_FLOPS_PER_TOKEN_PAIR = 2 * 48 * 32 * 128
PREFILL_MFU = 0.47
# The estimate error of the cost model: the engines' k1..k4 are the profile's times
# exp(N(0, COEF_SIGMA)) each (one draw per run, shared by the instances: one profile), on top
# of the 5% per-chunk noise. Calibrated, like PREFILL_MFU, on the paper: with 0.17 the mean
# |estimated - actual| / actual throughput over instance-periods is ~10% over seeds 0-5,
# Appendix B.2's 10.52% (docs/simulator.md).
COEF_SIGMA = 0.17
ESTIMATE_ERROR = EngineTruth(coef_sigma=COEF_SIGMA)


def qwen3_prefill(mfu: float = PREFILL_MFU) -> dict[str, float]:
    """``EngineCosts`` prefill fields for Qwen3-30B-A3B on one H20 at prefill MFU ``mfu``."""
    if not 0.0 < mfu <= 1.0:
        raise ValueError(f"mfu={mfu}: use a fraction in (0, 1]")
    flops = mfu * _H20_BF16_FLOPS
    return {
        "prefill_s_per_token": _PREFILL_FLOPS_PER_TOKEN / flops,
        "prefill_s_per_token_sq": _ATTENTION_FLOPS_PER_TOKEN_PAIR / flops,
    }


@dataclass(frozen=True, slots=True)
class Layout:
    rollout_gpus: int = 64
    train_gpus: int = 64
    gpus_per_instance: int = 1

    @property
    def total(self) -> int:
        return self.rollout_gpus + self.train_gpus


def paper_6_5(
    eta: int = 3,
    *,
    steps: int = 4,
    max_response: int = 20_000,
    layout: Layout = Layout(),
    seed: int = 0,
    noise: float = 0.05,
    prefill_mfu: float = PREFILL_MFU,
    truth: EngineTruth = ESTIMATE_ERROR,
    workload: WorkloadConfig | None = None,
) -> ClusterConfig:
    """Qwen3-30B-A3B on 128 H20 GPUs, batch 128 x group 16 (§6.1, §6.5).

    ``workload`` replaces the response-length model (its cap wins over ``max_response``);
    ``truth`` says how the engines differ from the coordinator's cost model."""
    return ClusterConfig(
        instances=layout.rollout_gpus // layout.gpus_per_instance,
        eta=eta,
        batch_size=128,
        group_size=16,
        steps=steps,
        coordinator=CoordinatorConfig(cost_model=CostModelConfig("qwen3-30b-a3b-h20")),
        engine=EngineCosts(pull_s=_PULL_S, noise=noise, truth=truth, **qwen3_prefill(prefill_mfu)),
        trainer=qwen3_trainer(layout.train_gpus),
        workload=workload or WorkloadConfig(max_response=max_response),
        seed=seed,
        name="staleflow",
    )


def qwen3_trainer(gpus: float) -> TrainerCosts:
    """Training Qwen3-30B-A3B on ``gpus`` H20s: linear layers per token, causal attention
    per squared sequence length, 10 s of fixed overhead per step, Push as a Pull."""
    flops = _TRAIN_FLOPS_PER_GPU * gpus
    return TrainerCosts(
        seconds_per_token=_TRAIN_FLOPS_PER_TOKEN / flops,
        step_overhead_s=10.0,
        push_s=_PULL_S,
        seconds_per_token_sq=_TRAIN_ATTENTION_FLOPS_PER_TOKEN_SQ / flops,
    )


def tiny(eta: int = 1, *, steps: int = 4, seed: int = 0) -> ClusterConfig:
    """A few seconds of virtual time per step, for tests: 4 instances with a small KV
    budget (so that preemption and migration happen), batch 4 x group 4, 2K responses."""
    return ClusterConfig(
        instances=4,
        eta=eta,
        batch_size=4,
        group_size=4,
        steps=steps,
        coordinator=CoordinatorConfig(
            period_s=0.5,
            cost_model=CostModelConfig("qwen3-30b-a3b-h20", kv_budget=12_000.0),
        ),
        engine=EngineCosts(prefill_s_per_token=2e-5, pull_s=0.5, noise=0.1),
        trainer=TrainerCosts(seconds_per_token=2e-4, step_overhead_s=0.5, push_s=0.3),
        workload=WorkloadConfig(max_response=2_000, prompt_median=50, max_prompt=200),
        seed=seed,
        name="staleflow",
    )


PRESETS: dict[str, Callable[..., ClusterConfig]] = {"paper-6.5": paper_6_5, "tiny": tiny}

# Systems of §6.1 / §6.5 expressed on the same simulated hardware.
SYSTEMS = ("staleflow", "sticky", "vanilla", "pipeline", "sync")


# The rules beyond the paper, by name, and the setting that turns each off (coordinator/
# config.py says what each does). ``staleflow-paper`` turns all off; ``staleflow-no-<rule>``
# turns one off.
RULES: dict[str, dict[str, Any]] = {
    "estimation": {"estimation": False},
    "fill": {"fill_steps": None},
    "pull": {"pull_kv": None},
    "fresh": {"fresh_admission": False},
    "whole-groups": {"whole_groups": False},
    "improving": {"improving_moves": False},
    "critical": {"critical_speedup": None},
    # off by default so far: ``staleflow-no-freshness`` is ``staleflow`` until it is on
    "freshness": {"freshness": FreshnessConfig()},
}
# The rules for multi-turn work (coordinator.agentic: AgenticRulesConfig), likewise:
# ``staleflow-no-locality`` etc. (``staleflow-no-home``: the cost model decides every
# move, however much room the fleet has); ``tool-waits`` turns off every rule that uses
# the learned tool waits (all but KV locality and its ``home_below``).
AGENTIC_RULES: dict[str, dict[str, Any]] = {
    "locality": {"kv_locality": False},
    "returns": {"expected_returns": False},
    "tool-pulls": {"tool_pulls": False},
    "tool-critical": {"tool_critical": False},
    "home": {"home_below": 0.0},
}
AGENTIC_RULES["tool-waits"] = {
    k: v
    for rule, off in AGENTIC_RULES.items()
    if rule not in ("locality", "home")
    for k, v in off.items()
}
# ``<system>+fresh``: that system with the freshness rule on (coordinator/freshness.py).
FRESH = "+fresh"
# ``<system>+stream``: that system with RolloutPipe's streamed training on (sim/trainer.py).
STREAM = "+stream"
PAPER_RULES: dict[str, Any] = {k: v for off in RULES.values() for k, v in off.items()}
PAPER_AGENTIC: dict[str, Any] = {k: v for off in AGENTIC_RULES.values() for k, v in off.items()}


def _strategies(config: ClusterConfig, routing: str, sync: str, migration: str) -> ClusterConfig:
    coord = replace(config.coordinator, routing=routing, synchronization=sync, migration=migration)
    return replace(config, coordinator=coord)


def system(name: str, config: ClusterConfig, layout: Layout | None = None) -> ClusterConfig:
    """``config`` turned into one of the compared systems.

    - ``staleflow``: the throughput-oriented routing, synchronisation and migration.
    - ``vanilla``: in-flight-limited strict staleness, baseline (3): at most
      ``(eta + 1) x batch`` groups in flight (the TS capacity), least-loaded routing,
      greedy (global) synchronisation with partial rollout, no proactive migration. The
      paper finds this all-vanilla combination matches VeRL-Async (§6.5).
    - ``sticky``: in-flight-limited strict staleness as VeRL-Async, AReaL and ROLL Flash
      run it (§2.4: one model version on the rollout side, fixed trajectory assignment):
      like ``vanilla``, but a trajectory interrupted by the global weight update resumes
      on the instance it ran on instead of being spread again over the emptied fleet.
    - ``pipeline``: one-step staleness, baseline (2) (VeRL-Pipeline): eta = 1 whatever
      ``config`` says, least-loaded routing, no migration, and the drain synchronisation:
      routing stops while the PS is newer, and once every instance is empty all of them
      Pull together, so every trajectory is generated by a single version (no partial
      rollout). The TS holds ``(eta + 1) x batch`` groups: the batch being generated plus
      the one being trained.
    - ``sync``: baseline (1), colocated synchronous RL: eta = 0, so rollout and training
      alternate, and both use all GPUs (``layout`` says how many; training speeds up by
      ``total / train_gpus``).
    - ``R?S?M?`` with ``1`` (throughput) or ``0`` (vanilla) per strategy, e.g. ``R1S0M1``:
      the eight combinations of Figure 16. A throughput slot includes its rules beyond
      the paper (the fill rule in R1, deferred Pulls in S1, improving moves and the
      critical-path rule in M1, speed estimation in any).
    - ``staleflow-paper``: the throughput strategies exactly as the paper writes them
      (:data:`RULES` all off); ``staleflow-no-<rule>``: StaleFlow without one rule.
    - ``<system>+fresh``: any of these with the freshness rule on (eta as a ceiling:
      coordinator/freshness.py), e.g. ``staleflow+fresh``.
    - ``<system>+stream``: any disaggregated one with RolloutPipe's streamed training on
      (``ClusterConfig.stream_training``; a real run's ``trainer.stream``), e.g.
      ``staleflow+stream``.
    """
    if name.endswith(FRESH):
        out = system(name.removesuffix(FRESH), config, layout)
        fresh = replace(out.coordinator.freshness, enabled=True)
        return replace(out, coordinator=replace(out.coordinator, freshness=fresh), name=name)
    if name.endswith(STREAM):
        out = system(name.removesuffix(STREAM), config, layout)
        if out.name.split("+")[0] == "sync":
            # its rollout and training take turns on the same GPUs: no idle trainer to
            # stream groups into while the rollout runs
            raise ValueError(
                f"{name!r}: sync colocates rollout and training, so nothing "
                "streams; use sync, or +stream on a disaggregated system"
            )
        return replace(out, stream_training=True, name=name)
    if name == "staleflow":
        return replace(_strategies(config, "throughput", "throughput", "throughput"), name=name)
    if name == "staleflow-paper" or name.startswith("staleflow-no-"):
        rule = name.removeprefix("staleflow-no-")
        if name != "staleflow-paper" and rule not in RULES and rule not in AGENTIC_RULES:
            known = sorted(RULES) + sorted(AGENTIC_RULES)
            raise ValueError(f"unknown rule {rule!r} in {name!r}: use one of {known}")
        off = PAPER_RULES if name == "staleflow-paper" else RULES.get(rule, {})
        agentic = PAPER_AGENTIC if name == "staleflow-paper" else AGENTIC_RULES.get(rule, {})
        out = _strategies(config, "throughput", "throughput", "throughput")
        coord = replace(out.coordinator, **off)
        coord = replace(coord, agentic=replace(coord.agentic, **agentic))
        return replace(out, coordinator=coord, name=name)
    if name == "vanilla":
        return replace(_strategies(config, "vanilla", "vanilla", "vanilla"), name=name)
    if name == "sticky":
        return replace(_strategies(config, "sticky", "vanilla", "vanilla"), name=name)
    if name == "pipeline":
        # The TS's default capacity is already (eta + 1) x batch_size groups.
        out = _strategies(config, "vanilla", "drain", "vanilla")
        return replace(out, eta=1, name=name)
    if name == "sync":
        layout = layout or Layout()
        trainer = config.trainer.sped_up(layout.total / layout.train_gpus)
        out = _strategies(config, "vanilla", "vanilla", "vanilla")
        return replace(
            out,
            eta=0,
            instances=layout.total // layout.gpus_per_instance,
            trainer=trainer,
            name=name,
        )
    if len(name) == 6 and name[0] == "R" and name[2] == "S" and name[4] == "M":
        flags = [name[1], name[3], name[5]]
        if set(flags) <= {"0", "1"}:
            pick = ["throughput" if f == "1" else "vanilla" for f in flags]
            return replace(_strategies(config, *pick), name=name)
    raise ValueError(f"unknown system {name!r}: use one of {SYSTEMS} or an ablation like 'R1S0M1'")


# -- the workloads of the experiment matrix (experiments/sim_matrix.py) -------------------

# Agentic work: where each number comes from is in docs/simulator_agentic.md.
SEARCH_AGENT = AgenticConfig(
    turns_median=3.0,
    turns_sigma=0.3,
    group_turns_sigma=0.4,
    max_turns=5,
    turn_tokens_median=250.0,
    turn_tokens_sigma=0.6,
    max_turn_tokens=500,
    obs_tokens_median=400.0,
    obs_tokens_sigma=0.3,
    max_obs_tokens=500,
    max_context=4608,
    latency_median_s=0.5,
    latency_sigma=1.0,
    latency_timeout_s=10.0,
    fail_prob=0.02,
    max_retries=1,
    prompt_median=150.0,
    prompt_sigma=0.5,
    max_prompt=2048,
)
SWE_AGENT = AgenticConfig(
    turns_median=25.0,
    turns_sigma=0.3,
    group_turns_sigma=0.5,
    max_turns=50,
    turn_tokens_median=250.0,
    turn_tokens_sigma=0.7,
    max_turn_tokens=4096,
    obs_tokens_median=400.0,
    obs_tokens_sigma=1.0,
    max_obs_tokens=2800,
    max_context=30_720,
    latency_median_s=2.0,
    latency_sigma=1.5,
    latency_timeout_s=60.0,
    fail_prob=0.02,
    max_retries=1,
    prompt_median=2000.0,
    prompt_sigma=0.3,
    max_prompt=4096,
)


def small_agentic(c: AgenticConfig) -> AgenticConfig:
    """``c`` at the ``tiny`` preset's scale (contexts of at most 2K tokens, a sixth of
    the turns), for tests and smoke runs: the same shape of waits, not a measurement."""
    return replace(
        c,
        turns_median=max(1.0, c.turns_median / 6.0),
        max_turns=max(2, c.max_turns // 6),
        turn_tokens_median=max(1.0, c.turn_tokens_median / 8.0),
        max_turn_tokens=max(8, c.max_turn_tokens // 8),
        obs_tokens_median=max(1.0, c.obs_tokens_median / 8.0),
        max_obs_tokens=max(8, c.max_obs_tokens // 8),
        max_context=2048,
        prompt_median=min(50.0, c.prompt_median),
        max_prompt=200,
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """A named variant of the §6.5 preset: what differs from it, and on how many GPUs.

    ``skewed``: the workload adds skew beyond the preset's own (a heavier or bimodal tail,
    within-group outliers, instances of unequal speed); the issue's 1.2x target is an
    average over these. The flag was set with the definitions, before any run.
    """

    name: str
    what: str
    gpus: int = 128
    max_response: int = 20_000
    workload: WorkloadConfig | None = None
    speed_sigma: float = 0.0
    skewed: bool = False
    # Agentic work (sim/agentic.py): multi-turn trajectories and their tools, in groups of
    # ``group`` x ``batch`` per step; ``keep_kv``: the engines cache a prefix across a
    # tool wait (EngineCosts.keep_kv). None: the §6.5 single-turn workload.
    agentic: AgenticConfig | None = None
    batch: int = 128
    group: int = 16
    keep_kv: bool = False

    def config(
        self,
        eta: int,
        *,
        steps: int,
        seed: int = 0,
        rollout_gpus: int | None = None,
        small: bool = False,
    ) -> ClusterConfig:
        """The cluster at ``eta``; ``rollout_gpus`` of the GPUs roll out (default half).

        ``small``: the same shape on the ``tiny`` preset (8 GPUs for 128, a 2K cap), for
        tests and smoke runs of the experiment scripts; not a measurement."""
        gpus = self.gpus if not small else max(8, self.gpus // 16)
        rollout = gpus // 2 if rollout_gpus is None else rollout_gpus
        if not 0 < rollout < gpus:
            raise ValueError(f"{self.name}: rollout_gpus={rollout} must be in (0, {gpus})")
        truth = EngineTruth(coef_sigma=COEF_SIGMA, speed_sigma=self.speed_sigma)
        if self.agentic is not None:
            return self._agentic(eta, steps, seed, rollout, gpus, truth, small)
        if small:
            base = tiny(eta, steps=steps, seed=seed)
            shape = replace(
                self.workload or WorkloadConfig(),
                max_response=2_000,
                prompt_median=50,
                max_prompt=200,
            )
            return replace(
                base,
                instances=rollout,
                trainer=base.trainer.sped_up((gpus - rollout) / 4),
                engine=replace(base.engine, truth=truth),
                workload=shape,
            )
        return paper_6_5(
            eta,
            steps=steps,
            seed=seed,
            max_response=self.max_response,
            layout=Layout(rollout, gpus - rollout),
            truth=truth,
            workload=self.workload,
        )

    def _agentic(
        self,
        eta: int,
        steps: int,
        seed: int,
        rollout: int,
        gpus: int,
        truth: EngineTruth,
        small: bool,
    ) -> ClusterConfig:
        agentic = self.agentic
        assert agentic is not None
        if small:  # the tiny preset's cache holds 12K tokens: contexts of at most 2K
            base = tiny(eta, steps=steps, seed=seed)
            agentic = small_agentic(agentic)
            base = replace(
                base,
                instances=rollout,
                trainer=base.trainer.sped_up((gpus - rollout) / 4),
                engine=replace(base.engine, truth=truth),
            )
        else:
            base = paper_6_5(
                eta, steps=steps, seed=seed, layout=Layout(rollout, gpus - rollout), truth=truth
            )
            base = replace(base, batch_size=self.batch, group_size=self.group)
        return replace(
            base,
            agentic=agentic,
            workload=agentic.as_workload(),
            engine=replace(base.engine, keep_kv=self.keep_kv),
        )

    def total_gpus(self, small: bool = False) -> int:
        return self.gpus if not small else max(8, self.gpus // 16)

    def system(
        self, name: str, eta: int, *, steps: int, seed: int, rollout_gpus: int, small: bool
    ) -> ClusterConfig:
        """System ``name`` (:func:`system`) on this workload, ``rollout_gpus`` of its GPUs
        rolling out and the rest training."""
        base = self.config(eta, steps=steps, seed=seed, rollout_gpus=rollout_gpus, small=small)
        return system(name, base, Layout(rollout_gpus, self.total_gpus(small) - rollout_gpus))


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("preset-20k", "the §6.5 preset at the §6.1 cap (20K)"),
        Workload("preset-40k", "the §6.5 setting itself: 40K cap", max_response=40_000),
        Workload(
            "heavy-tail",
            "group medians lognormal around 0.15 x cap with sigma 1.3 (preset: 0.25, 0.9)",
            workload=WorkloadConfig(group_median_frac=0.15, group_sigma=1.3),
            skewed=True,
        ),
        Workload(
            "bimodal",
            "30% long groups (median 0.6 x cap, sigma 0.3), 70% short (0.05 x cap, sigma 0.5)",
            workload=WorkloadConfig(
                group_median_frac=0.05,
                group_sigma=0.5,
                long_frac=0.3,
                long_median_frac=0.6,
                long_sigma=0.3,
            ),
            skewed=True,
        ),
        Workload(
            "hetero-0.1",
            "instance speeds lognormal, sigma 0.1 (persistent, unseen by the cost model)",
            speed_sigma=0.1,
            skewed=True,
        ),
        Workload(
            "hetero-0.2",
            "instance speeds lognormal, sigma 0.2 (persistent, unseen by the cost model)",
            speed_sigma=0.2,
            skewed=True,
        ),
        Workload(
            "outliers",
            "each member runs away to the cap with probability 1/16 (within-group outliers)",
            workload=WorkloadConfig(outlier_prob=1 / 16),
            skewed=True,
        ),
        Workload("gpus-512", "512 GPUs, batch 128 (§6.4's GPU scaling)", gpus=512),
        Workload(
            "search-agent",
            "a search agent: up to 5 turns (4 searches), short turns and passages, "
            "sub-second retrieval; batch 512 x 5 (Search-R1's train_grpo.sh)",
            agentic=SEARCH_AGENT,
            batch=512,
            group=5,
            keep_kv=True,
            skewed=True,
        ),
        Workload(
            "swe-agent",
            "a software-engineering agent: ~25 turns (at most 50) in a 30K context, "
            "shell commands of heavy-tailed latency up to a 60 s timeout; batch 64 x 8",
            agentic=SWE_AGENT,
            batch=64,
            group=8,
            keep_kv=True,
            skewed=True,
        ),
    )
}
AGENTIC = tuple(name for name, w in WORKLOADS.items() if w.agentic is not None)
