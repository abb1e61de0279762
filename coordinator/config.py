"""The coordinator's section of the configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from coordinator.cost_model import PRESETS, CostModel

STRATEGY_NAMES = ("throughput", "vanilla")
# Synchronisation has one more: "drain", the one-step-overlap baseline's global Pull after a
# full drain (coordinator/drain_sync.py). It has no routing or migration counterpart.
SYNC_NAMES = (*STRATEGY_NAMES, "drain")
# Routing has one more: "sticky", least-loaded routing where a trajectory keeps its first
# instance (the in-flight-limited systems' fixed assignment, coordinator/vanilla_routing.py).
ROUTING_NAMES = (*STRATEGY_NAMES, "sticky")


# Largest values of the numeric keys (their metadata "max", checked by the run
# configuration before anything starts), each with why.
MAX_COEFFICIENT = 1e6
COEFFICIENT_WHY = (
    "seconds per KV token or trajectory, or KV tokens per token: a million is no engine"
)
MAX_KV_TOKENS = float(2**31 - 1)
KV_WHY = "KV tokens of one instance, indexed by int32 offsets (rollout.kv_budget_tokens)"
MAX_TOKENS = 2**24
TOKENS_WHY = "tokens of one response: 16M is above any model's context (the longest, 10M)"
MAX_QUEUE = 65_536
MAX_COPIES = 10_000


class ConfigError(ValueError):
    """A coordinator setting is out of range; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    """Which cost model to use: a named preset, with any coefficient overridden.

    Units: k1 s per KV token, k2 and k4 s, k3 s per running trajectory, k5 KV tokens per
    trajectory token, kv_budget (M) KV tokens per instance.
    """

    preset: str = field(default="qwen3-30b-a3b-h20", metadata={"help": f"one of {sorted(PRESETS)}"})
    k1: float | None = field(
        default=None, metadata={"max": MAX_COEFFICIENT, "max_why": COEFFICIENT_WHY}
    )
    k2: float | None = field(
        default=None, metadata={"max": MAX_COEFFICIENT, "max_why": COEFFICIENT_WHY}
    )
    k3: float | None = field(
        default=None, metadata={"max": MAX_COEFFICIENT, "max_why": COEFFICIENT_WHY}
    )
    k4: float | None = field(
        default=None, metadata={"max": MAX_COEFFICIENT, "max_why": COEFFICIENT_WHY}
    )
    k5: float | None = field(
        default=None, metadata={"max": MAX_COEFFICIENT, "max_why": COEFFICIENT_WHY}
    )
    kv_budget: float | None = field(
        default=None, metadata={"max": MAX_KV_TOKENS, "max_why": KV_WHY}
    )
    prefill_s_per_token: float | None = field(
        default=None,
        metadata={
            "help": "seconds per prefilled token (multi-turn KV-locality routing)",
            "max": MAX_COEFFICIENT,
            "max_why": COEFFICIENT_WHY,
        },
    )
    prefill_s_per_token_sq: float | None = field(
        default=None,
        metadata={
            "help": "seconds per squared prefilled length (causal attention)",
            "max": MAX_COEFFICIENT,
            "max_why": COEFFICIENT_WHY,
        },
    )

    def build(self) -> CostModel:
        if self.preset not in PRESETS:
            raise ConfigError(
                f"coordinator.cost_model.preset={self.preset!r} is unknown: use one of "
                f"{sorted(PRESETS)}, or fit your engine with coordinator.profiler and pass "
                "k1..k5 and kv_budget explicitly"
            )
        overrides = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "preset" and getattr(self, f.name) is not None
        }
        for name, value in overrides.items():
            # k5 and the KV budget divide: they must be > 0; the others are times, >= 0
            positive = name in ("k5", "kv_budget")
            if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
                example = getattr(PRESETS[self.preset], name)
                raise ConfigError(
                    f"coordinator.cost_model.{name}={value!r} must be a number "
                    f"{'> 0' if positive else '>= 0'}: use e.g. {example:g} (the "
                    f"{self.preset} preset's), or null for the preset's"
                )
        try:
            return replace(PRESETS[self.preset], **overrides)
        except ValueError as e:
            raise ConfigError(f"coordinator.cost_model: {e}") from e


@dataclass(frozen=True, slots=True)
class SeerConfig:
    """Seer's divided rollout and context-aware scheduling (coordinator/seer.py)."""

    enabled: bool = field(
        default=False,
        metadata={
            "help": "routes hand out chunks of chunk_tokens; each group's first member is a "
            "probe routed shortest-generated-first, the others longest-estimated-first, "
            "within each MLQ level (seer.md Algorithm 1)"
        },
    )
    chunk_tokens: int = field(
        default=8192,
        metadata={
            "help": "response tokens one route may add before the trajectory returns to the "
            "TS to be re-placed (Seer: 8K); only used when enabled",
            "max": MAX_TOKENS,
            "max_why": TOKENS_WHY,
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"coordinator.seer.enabled={self.enabled!r} must be true or false")
        if (
            isinstance(self.chunk_tokens, bool)
            or not isinstance(self.chunk_tokens, int)
            or self.chunk_tokens < 1
        ):
            raise ConfigError(
                f"coordinator.seer.chunk_tokens={self.chunk_tokens!r} must be an integer >= 1 "
                "(response tokens per chunk, e.g. 8192)"
            )

    @property
    def chunk(self) -> int | None:
        """The chunk size routes hand out, None when divided rollout is off."""
        return self.chunk_tokens if self.enabled else None


@dataclass(frozen=True, slots=True)
class RaceConfig:
    """SpecActor's fastest-of-N as a tail race (coordinator/race.py)."""

    enabled: bool = field(
        default=False,
        metadata={
            "help": "copies of the oldest buffer's running stragglers race on idle instances "
            "of the same weights version; the first to finish completes the trajectory, the "
            "others are aborted (the simulator; launch with the embedded engine or vLLM)"
        },
    )
    copies: int = field(
        default=1,
        metadata={
            "help": "copies one trajectory may have racing at once (besides itself)",
            "max": MAX_COPIES,
            "max_why": "copies race on idle instances, and no cluster runs more than 10,000",
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"coordinator.race.enabled={self.enabled!r} must be true or false")
        if isinstance(self.copies, bool) or not isinstance(self.copies, int) or self.copies < 1:
            raise ConfigError(
                f"coordinator.race.copies={self.copies!r} must be an integer >= 1 (copies of "
                "one straggler racing at once, e.g. 1)"
            )


@dataclass(frozen=True, slots=True)
class FreshnessConfig:
    """eta as a ceiling, not a target (coordinator/freshness.py)."""

    enabled: bool = field(
        default=False,
        metadata={
            "help": "admit a new group no earlier than it must start to be complete when the "
            "trainer wants its buffer (the trainer's measured step time, the group's "
            "estimated completion time and a learned margin), so the data is as fresh as "
            "the speed allows; gives way to today's admission while the trainer waits; "
            "false: admit as soon as eta allows, as in the paper"
        },
    )
    quantile: float = field(
        default=0.9,
        metadata={
            "help": "the margin is this quantile of how late recent buffers filled against "
            "their groups' estimates (seconds, completions counted in admission order); "
            "higher starts groups earlier (staler, safer)",
            "max": 1.0,
            "max_why": "a quantile (the margin may not cover more than every group)",
        },
    )
    give_way: float = field(
        default=0.02,
        metadata={
            "help": "the rule steps aside while the trainer's mean wait for its buffer over "
            "its last steps exceeds this share of its step time (the rollout binds, or the "
            "rule started groups too late)",
            "max": 1.0,
            "max_why": "a share of the trainer's step time",
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(
                f"coordinator.freshness.enabled={self.enabled!r} must be true or false"
            )
        if isinstance(self.quantile, bool) or not 0.5 <= self.quantile < 1.0:
            raise ConfigError(
                f"coordinator.freshness.quantile={self.quantile!r} is out of range: use a "
                "quantile in [0.5, 1) (e.g. 0.9: the margin covers 9 groups in 10)"
            )
        if isinstance(self.give_way, bool) or not 0.0 <= self.give_way <= 1.0:
            raise ConfigError(
                f"coordinator.freshness.give_way={self.give_way!r} is out of range: use a "
                "share of the trainer's step time in [0, 1] (e.g. 0.02)"
            )


@dataclass(frozen=True, slots=True)
class AgenticRulesConfig:
    """Multi-turn (agentic) work: rules for trajectories that wait on their environment
    between model turns (coordinator/agentic.py). They read the snapshots' ``env_trajs``
    and ``held`` (types.InstanceSnapshot), so with single-turn work they change nothing;
    each is switchable for the ablation. Throughput strategies only."""

    kv_locality: bool = field(
        default=True,
        metadata={
            "help": "a next turn goes back to the instance caching its prefix unless the "
            "cost model says moving it is faster (prefill of the prefix against Eq. 3)"
        },
    )
    home_below: float = field(
        default=0.3,
        metadata={
            "help": "with kv_locality: a next turn goes back to the instance caching its "
            "prefix whenever that instance can run it now, while the fleet's mean KV in use "
            "is under this share of the budget (every instance has room, so a move's "
            "throughput gain is not there to take and its prefill is); 0: the cost model "
            "decides every move (docs/simulator_agentic.md)",
            "max": 1.0,
            "max_why": "a share of the KV budget",
        },
    )
    expected_returns: bool = field(
        default=True,
        metadata={
            "help": "new trajectories are admitted, and migration weighs its moves, as if "
            "the waiting trajectories expected back within a turn's time (learned online) "
            "were running already"
        },
    )
    tool_critical: bool = field(
        default=True,
        metadata={
            "help": "the critical-path rule and the synchronisation's holds count the "
            "trajectories waiting on tools in the oldest version and its tail "
            "(coordinator/critical.py oldest_tail)"
        },
    )
    tool_pulls: bool = field(
        default=True,
        metadata={
            "help": "synchronisation weighs a Pull by the KV it discards that the fleet needs "
            "again soon (decoding, and the cached prefixes of trajectories expected back "
            "from their tools within a turn's time): deferred Pulls (pull_kv) count those "
            "prefixes, and a lagging instance under pull_kv, holding no trajectory of the "
            "oldest version in flight, is Pulled when new work waits for an instance at the "
            "PS's version (coordinator/sync.py); false: Algorithm 4 "
            "alone, which keeps an instance at its version while any next turn could resume "
            "there, so new groups wait for the whole fleet to drain "
            "(docs/simulator_agentic.md)"
        },
    )
    prior_wait_s: float = field(
        default=5.0,
        metadata={
            "help": "mean environment wait assumed until 16 waits were measured (seconds)",
            "max": 86_400.0,
            "max_why": "a tool call of more than a day",
        },
    )
    prior_turn_tokens: int = field(
        default=256,
        metadata={
            "help": "tokens a model turn decodes, assumed until 16 turns were measured",
            "max": MAX_TOKENS,
            "max_why": TOKENS_WHY,
        },
    )

    def __post_init__(self) -> None:
        for name in ("kv_locality", "expected_returns", "tool_pulls", "tool_critical"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"coordinator.agentic.{name}={getattr(self, name)!r} must be true or false"
                )
        if isinstance(self.home_below, bool) or not 0.0 <= self.home_below <= 1.0:
            raise ConfigError(
                f"coordinator.agentic.home_below={self.home_below!r} is out of range: use a "
                "share of the KV budget in [0, 1] (e.g. 0.3; 0 turns the rule off)"
            )
        if isinstance(self.prior_wait_s, bool) or not self.prior_wait_s > 0:
            raise ConfigError(
                f"coordinator.agentic.prior_wait_s={self.prior_wait_s!r} must be > 0 seconds "
                "(e.g. 5.0)"
            )
        if (
            isinstance(self.prior_turn_tokens, bool)
            or not isinstance(self.prior_turn_tokens, int)
            or self.prior_turn_tokens < 1
        ):
            raise ConfigError(
                f"coordinator.agentic.prior_turn_tokens={self.prior_turn_tokens!r} must be an "
                "integer >= 1 (tokens of a model turn, e.g. 256)"
            )

    @property
    def any(self) -> bool:
        return self.kv_locality or self.expected_returns or self.tool_pulls


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Strategies (§5.3 or their §6.5 vanilla counterparts), their hyper-parameters and the
    cycle period. Each strategy is chosen independently."""

    routing: str = field(default="throughput", metadata={"help": "throughput | vanilla | sticky"})
    synchronization: str = field(
        default="throughput", metadata={"help": "throughput | vanilla | drain"}
    )
    migration: str = field(default="throughput", metadata={"help": "throughput | vanilla"})
    mu: float = field(
        default=0.3,
        metadata={
            "help": "route only where the gain is >= mu x an idle instance's gain",
            "max": 1.0,
            "max_why": "a share of an idle instance's gain",
        },
    )
    phi_wait: int = field(
        default=3,
        metadata={
            "help": "queued trajectories kept per instance",
            "max": MAX_QUEUE,
            "max_why": "trajectories queued on one instance, at most its batch slots (rollout.max_running)",
        },
    )
    phi_throughput: float = field(
        default=5.0,
        metadata={
            "help": "max ratio of highest to lowest instance throughput",
            "max": 1000.0,
            "max_why": "a ratio of instance throughputs: no fleet is 1,000x uneven",
        },
    )
    period_s: float = field(
        default=1.0,
        metadata={
            "help": "seconds between snapshot cycles",
            "max": 3600.0,
            "max_why": "seconds between routing cycles: an hour routes nothing",
        },
    )
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    estimation: bool = field(
        default=True,
        metadata={
            "help": "learn each instance's speed online from its snapshots and use it in "
            "routing, synchronisation and migration (coordinator/estimation.py); false: "
            "every instance follows the profiled cost model, as in the paper"
        },
    )
    fill_steps: int | None = field(
        default=6000,
        metadata={
            "help": "throughput routing places every admissible new trajectory on an instance "
            "whose KV cache, with it, still holds this many decode steps of the whole "
            "batch, whatever mu says (coordinator/gains.py spare()); set it near your mean "
            "response length (about a third of the response cap on reasoning workloads), "
            "the growth each running trajectory is still expected to make; null: mu "
            "decides everywhere, as in the paper",
            "max": MAX_TOKENS,
            "max_why": "decode steps of headroom: no response is longer",
        },
    )

    pull_kv: float | None = field(
        default=0.5,
        metadata={
            "help": "throughput synchronisation Pulls a lagging instance only once the KV "
            "cache of what it runs is at most this share of the budget: a Pull interrupts "
            "and re-prefills all of it; only while the fleet is loaded (a mean batch of at "
            "least k2/k3 or a mean KV of at least this share; coordinator/sync.py); with the "
            "throughput routing only (least-loaded routing keeps caches full); null: "
            "Algorithm 4 as written",
            "max": 1.0,
            "max_why": "a share of the KV budget",
        },
    )
    fresh_admission: bool = field(
        default=True,
        metadata={
            "help": "throughput routing starts new trajectories only on instances at the PS's "
            "version; an instance behind it resumes partial trajectories and drains "
            "(coordinator/routing.py); false: the waterfall admits new work at old versions "
            "too, as in the paper"
        },
    )
    whole_groups: bool = field(
        default=True,
        metadata={
            "help": "throughput routing places every member of a group in the pass that "
            "starts it, the rest on the best instance with room even below mu, so a group "
            "starts at one version (coordinator/routing.py); false: a pass may stop inside "
            "a group, as in the paper"
        },
    )
    improving_moves: bool = field(
        default=True,
        metadata={
            "help": "migration case 2 moves only the trajectories whose move raises the "
            "estimated throughput by mu x an idle instance's gain (coordinator/migration.py); "
            "false: every trajectory of the highest-throughput instance, as in the paper"
        },
    )
    critical_speedup: float | None = field(
        default=1.5,
        metadata={
            "help": "move a trajectory of the oldest buffer's tail to the instance where its "
            "steps are at least this many times faster (coordinator/critical.py); null: "
            "off, as in the paper",
            "max": 1000.0,
            "max_why": "a speed ratio between instances, bounded as phi_throughput",
        },
    )

    critical_tail: int = field(
        default=8,
        metadata={
            "help": "the oldest version's trajectories in flight are the trainer's critical "
            "path once at most this many per instance remain: the critical-path rule may "
            "move them, and the throughput synchronisation does not Pull an instance "
            "running one while its Pulls are deferred (pull_kv) (coordinator/critical.py, "
            "sync.py); 1: one per instance, the rule's first version",
            "max": MAX_QUEUE,
            "max_why": "trajectories per instance, at most its batch slots",
        },
    )

    seer: SeerConfig = field(default_factory=SeerConfig)
    race: RaceConfig = field(default_factory=RaceConfig)
    freshness: FreshnessConfig = field(default_factory=FreshnessConfig)
    agentic: AgenticRulesConfig = field(default_factory=AgenticRulesConfig)

    def __post_init__(self) -> None:
        for name in ("routing", "synchronization", "migration"):
            value = getattr(self, name)
            if (
                value in STRATEGY_NAMES
                or (name == "synchronization" and value in SYNC_NAMES)
                or (name == "routing" and value in ROUTING_NAMES)
            ):
                continue
            extra = {
                "synchronization": ", or 'drain' (Pull all instances together once all are "
                "empty: one-step overlap without partial rollout, VeRL-Pipeline)",
                "routing": ", or 'sticky' (least-loaded, and a trajectory keeps its first "
                "instance: the fixed assignment of VeRL-Async / AReaL / ROLL Flash)",
            }.get(name, "")
            raise ConfigError(
                f"coordinator.{name}={value!r} is unknown: use 'throughput' (the paper's "
                f"strategy) or 'vanilla' (its §6.5 ablation counterpart){extra}"
            )
        if not 0.0 < self.mu <= 1.0:
            raise ConfigError(
                f"coordinator.mu={self.mu} is out of range: use a value in (0, 1]; it is the "
                "share of an idle instance's throughput gain a route must reach (paper: 0.3)"
            )
        if isinstance(self.phi_wait, bool) or not isinstance(self.phi_wait, int):
            raise ConfigError(f"coordinator.phi_wait={self.phi_wait!r} must be an integer >= 0")
        if self.phi_wait < 0:
            raise ConfigError(
                f"coordinator.phi_wait={self.phi_wait} is negative: use the number of queued "
                "trajectories an instance may keep before the excess migrates (paper: 3)"
            )
        if not self.phi_throughput >= 1.0:
            raise ConfigError(
                f"coordinator.phi_throughput={self.phi_throughput} is below 1: it bounds the "
                "ratio of the highest to the lowest instance throughput, so use >= 1 "
                "(paper: 5)"
            )
        if self.fill_steps is not None and (
            isinstance(self.fill_steps, bool)
            or not isinstance(self.fill_steps, int)
            or self.fill_steps < 0
        ):
            raise ConfigError(
                f"coordinator.fill_steps={self.fill_steps!r} must be an integer >= 0 (decode "
                "steps of headroom, e.g. 2000), or null to let mu decide everywhere"
            )
        if self.pull_kv is not None and (
            isinstance(self.pull_kv, bool) or not 0.0 <= self.pull_kv <= 1.0
        ):
            raise ConfigError(
                f"coordinator.pull_kv={self.pull_kv!r} is out of range: use a fraction of the "
                "KV budget in [0, 1] (e.g. 0.25), or null for Algorithm 4 as written"
            )
        if self.critical_speedup is not None and (
            isinstance(self.critical_speedup, bool) or not self.critical_speedup > 1.0
        ):
            raise ConfigError(
                f"coordinator.critical_speedup={self.critical_speedup!r} must be > 1 (e.g. "
                "1.5: move a critical trajectory where its steps are 1.5x faster), or null"
            )
        if (
            isinstance(self.critical_tail, bool)
            or not isinstance(self.critical_tail, int)
            or self.critical_tail < 1
        ):
            raise ConfigError(
                f"coordinator.critical_tail={self.critical_tail!r} must be an integer >= 1 "
                "(trajectories of the oldest version per instance, e.g. 8)"
            )
        for name in ("estimation", "fresh_admission", "whole_groups", "improving_moves"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"coordinator.{name}={getattr(self, name)!r} must be true or false"
                )
        if not self.period_s > 0.0:
            raise ConfigError(
                f"coordinator.period_s={self.period_s} must be > 0 seconds (e.g. 1.0)"
            )
        if not isinstance(self.seer, SeerConfig):
            raise ConfigError("coordinator.seer must be a SeerConfig")
        if not isinstance(self.race, RaceConfig):
            raise ConfigError("coordinator.race must be a RaceConfig")
        if not isinstance(self.freshness, FreshnessConfig):
            raise ConfigError("coordinator.freshness must be a FreshnessConfig")
        if not isinstance(self.agentic, AgenticRulesConfig):
            raise ConfigError("coordinator.agentic must be an AgenticRulesConfig")
        if not isinstance(self.cost_model, CostModelConfig):
            raise ConfigError("coordinator.cost_model must be a CostModelConfig")
        self.cost_model.build()  # fail now, not at the first cycle

    def for_responses(self, max_response: int) -> CoordinatorConfig:
        """This config for responses capped at ``max_response`` tokens: the fill rule's
        headroom is the growth a running trajectory is still expected to make, and none
        grows past the cap, so a larger headroom would only withhold work (at the
        launch's default 32-token cap, 6,000 would leave two trajectories per instance)."""
        if self.fill_steps is None or self.fill_steps <= max_response:
            return self
        return replace(self, fill_steps=max_response)
