"""How the command line prints a message: verbatim, never as rich markup."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


def print_text(console: Console, text: str, *, style: str = "", label: str = "") -> None:
    """Print ``text`` verbatim, after ``label`` in ``style`` when given. Messages are never
    read as rich markup: "pip install -e '.[megatron]'" printed as markup loses its extra
    (rich takes ``[megatron]`` for a style tag), and a path may hold brackets too."""
    from rich.text import Text

    line = Text.assemble((label, style), " ", text) if label else Text(text, style=style)
    console.print(line, highlight=False)
