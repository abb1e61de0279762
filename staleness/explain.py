"""What the staleness manager says when it refuses: each message names the fix."""

from __future__ import annotations

from staleness.feasibility import AdmissionCounts


def rejection(counts: AdmissionCounts, eta: int, v_traj: int) -> str:
    """Why a Reserve of ``v_traj`` was refused."""
    if counts.deadline(v_traj) < 0:
        return (
            f"V_traj={v_traj} is older than eta={eta} allows at trainer version "
            f"{counts.version}; sync the instance to a newer version first"
        )
    return (
        f"no free entry in buffers {counts.version}..{v_traj + eta} for "
        f"V_traj={v_traj} (eta={eta}); route to an instance with a newer version "
        "or wait for the trainer to consume"
    )


def not_ready(counts: AdmissionCounts, batch_size: int) -> str:
    """Why a Consume was refused."""
    r = sum(counts.reserved)
    y = counts.pinned_by_buffer()
    return (
        f"buffer {counts.version} is not Ready: {y[0]} occupied of the {batch_size} "
        f"needed ({r} groups reserved in flight); wait with wait_ready() before consume()"
    )
