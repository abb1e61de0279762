"""``staleflow dashboard``: serve the web dashboard of a run folder, a live run or a simulation."""

from __future__ import annotations

import argparse
import logging
import sys

from staleflow.dashboard.sources import SourceError, open_source
from staleflow.install import missing

try:  # FastAPI and uvicorn are an optional extra: without them the command says what to install
    from staleflow.dashboard.app import create_app
    from staleflow.dashboard.server import DEFAULT_PORT, DashboardServer, bind, bind_preferred
except ImportError as exc:
    _MISSING: ImportError | None = exc
else:
    _MISSING = None


def run(args: argparse.Namespace) -> int:
    if _MISSING is not None:
        print(
            f"staleflow dashboard: {missing('fastapi, fastapi-offline or uvicorn', _MISSING)}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("staleflow.dashboard").warning(
            "serving on %s: anyone who can reach this port can read the run", args.host
        )
    try:
        sock = (
            bind_preferred(args.host, DEFAULT_PORT)
            if args.port is None
            else bind(args.host, args.port)
        )
    except OSError as exc:
        print(f"staleflow dashboard: {exc}", file=sys.stderr)
        return 2
    try:
        source = open_source(
            args.folder,
            address=args.address,
            run=args.run,
            run_dir=args.run_dir,
            sim=args.sim,
            sim_options={
                "system": args.system,
                "eta": args.eta,
                "steps": args.steps,
                "seed": args.seed,
                "speed": args.speed,
            },
        )
    except SourceError as exc:
        sock.close()
        print(f"staleflow dashboard: {exc}", file=sys.stderr)
        return 2
    server = DashboardServer(create_app(source, token=args.token), sock)
    print(f"staleflow dashboard at {server.url} (API docs at {server.url}docs; Ctrl-C stops)")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        source.close()
    return 0
