"""``staleflow status``: one summary of a run folder or a live run."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from staleflow.dashboard.sources import SourceError, open_source
from staleflow.dashboard.status import resume_view, status_view


def run(args: argparse.Namespace) -> int:
    try:
        source = open_source(
            args.folder, address=args.address, run=args.run, run_dir=args.run_dir, poll=False
        )
    except SourceError as exc:
        print(f"staleflow status: {exc}", file=sys.stderr)
        return 2
    try:
        summary = getattr(source, "summary", None)
        console = Console()
        console.print(status_view(source, summary))
        folder = args.folder or args.run_dir
        if folder:
            console.print(resume_view(folder))
    finally:
        source.close()
    return 0
