"""The exact command that installs a missing piece, for messages that name one.

The default install (``pip install -c constraints.txt -e .``, what ``scripts/setup`` does)
holds everything ``staleflow launch`` and the default tests use, the dashboard included;
only GPU stacks and a few optional tools are extras (``pyproject.toml``). A message about
a missing module therefore says how to repair the default install, or which extra adds
the piece, as a command that runs as printed: this interpreter's pip, and the checkout's
own constraints file when staleflow runs from a source checkout. Standard library only.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

# the checkout holding this package, when it runs from one (an editable install)
_ROOT = Path(__file__).resolve().parent.parent


def install_command(extra: str = "") -> str:
    """``python -m pip install ...`` for the default install (``extra`` empty) or for
    staleflow with the extra ``extra``, into the environment running now."""
    python = shlex.quote(sys.executable)
    suffix = f"[{extra}]" if extra else ""
    if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "constraints.txt").is_file():
        # the constraints keep torch on its CPU build (unpinned: GBs of CUDA wheels)
        constraints = shlex.quote(str(_ROOT / "constraints.txt"))
        return f"{python} -m pip install -c {constraints} -e {shlex.quote(f'{_ROOT}{suffix}')}"
    return f"{python} -m pip install {shlex.quote(f'staleflow{suffix}')}"


def missing(what: str, exc: BaseException | None = None, extra: str = "") -> str:
    """``"<what> is not installed (<exc>); install it with: <command>"``: ``extra`` names
    the extra that adds it, empty when it belongs to the default install."""
    where = f"the '{extra}' extra" if extra else "the default install"
    cause = f" ({exc})" if exc is not None else ""
    return f"{what} is missing{cause}; it comes with {where}: {install_command(extra)}"
