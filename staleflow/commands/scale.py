"""``staleflow scale``: ask a running run for more or fewer rollout instances."""

from __future__ import annotations

import argparse
import sys

from staleflow.runtime.driver.elastic import ScaleError, request_scale


def run(args: argparse.Namespace) -> int:
    try:
        print(request_scale(args.run, args.address, args.instances, args.add, args.remove))
    except ScaleError as exc:
        print(f"staleflow scale: {exc}", file=sys.stderr)
        return 2
    return 0
