"""The ``recovery`` section: how a run checkpoints, and how it survives lost actors
(``docs/recovery.md``). ``checkpoint_every`` itself is a top-level key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from staleflow.config.checks import (
    MAX_WAIT_S,
    WAIT_WHY,
)
from staleflow.config.sections import _help, require_at_least, require_positive
from staleflow.config.walk import check_types


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    """Checkpoints, progress reports and restarts."""

    KEY: ClassVar[str] = "recovery"

    keep: int = field(
        default=2,
        metadata=_help(
            "run checkpoints kept in checkpoints/ (the newest ones)",
            1000,
            "each is a whole checkpoint on disk",
        ),
    )
    progress_every_s: float = field(
        default=2.0,
        metadata=_help(
            "how often a rollout instance reports its partial responses to the TS; a lost "
            "instance costs the tokens generated since its last report (0 = never)",
            MAX_WAIT_S,
            WAIT_WHY,
        ),
    )
    max_restarts: int = field(
        default=3,
        metadata=_help(
            "restarts of each rollout instance, reward worker and PS replica; a rollout "
            "instance out of restarts leaves the run, which goes on without it",
            10_000,
            "restarts of one actor: each takes seconds, so 10,000 is a crash loop",
        ),
    )
    snapshot_timeout_s: float = field(
        default=60.0,
        metadata=_help(
            "a rollout instance that answers no snapshot for this long is declared lost "
            "(a dead process is noticed at once)",
            MAX_WAIT_S,
            WAIT_WHY,
        ),
    )
    ps_patience_s: float = field(
        default=120.0,
        metadata=_help(
            "how long clients wait for a restarted parameter-server replica", MAX_WAIT_S, WAIT_WHY
        ),
    )
    audit_log: bool = field(
        default=False,
        metadata=_help(
            "write audit.jsonl: every consumed trajectory with its tokens and per-token "
            "versions (for checking a run; large at scale)"
        ),
    )

    def __post_init__(self) -> None:
        check_types(self, self.KEY)
        require_at_least("recovery.keep", self.keep, 1, "checkpoint")
        require_at_least("recovery.progress_every_s", self.progress_every_s, 0, "s (0 = never)")
        require_at_least("recovery.max_restarts", self.max_restarts, 0, "restarts")
        require_positive("recovery.snapshot_timeout_s", self.snapshot_timeout_s, "60")
        require_positive("recovery.ps_patience_s", self.ps_patience_s, "120")
