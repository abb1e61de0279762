"""The staleness buffers as a terminal table (Figure 7): one row per buffer, its entries
as slots. Drawn here only, for ``staleflow launch``'s live panel, ``staleflow status``
and ``staleflow demo`` (a rich renderable; printing is the caller's business)."""

from __future__ import annotations

from rich.table import Table

from staleness.types import BufferState, ManagerView

STATE_COLOUR = {
    BufferState.WAITING: "yellow",
    BufferState.READY: "green",
    BufferState.STUCK: "red",
}


def buffers_table(view: ManagerView, title: str | None = None) -> Table:
    """Buffers ``V_buf = version .. version + eta``; a slot is ``O`` (occupied), ``r``
    (reserved) or ``.`` (free)."""
    table = Table(title=title or f"staleness buffers (trainer at v{view.version}, eta={view.eta})")
    table.add_column("V_buf")
    table.add_column("state")
    table.add_column("slots (O occupied, r reserved, . free)")
    for b in view.buffers:
        slots = "".join("O" if e.kind == "occupied" else "r" for e in b.entries)
        slots += "." * max(b.capacity - len(b.entries), 0)
        state = f"[{STATE_COLOUR.get(b.state, 'white')}]{b.state.value}[/]"
        table.add_row(f"buffer {b.version}", state, slots)
    return table
