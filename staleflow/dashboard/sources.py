"""Opening the source a command names: a run folder, a live job on a Ray cluster, or a
simulated run. Errors are ``SourceError`` with a message that says what to pass."""

from __future__ import annotations

from typing import Any

from staleflow.dashboard.folder_source import FolderError, FolderSource
from staleflow.dashboard.interface import RunSource
from staleflow.dashboard.ray_source import AttachError, RaySource
from staleflow.dashboard.sim_source import SimSource
from staleflow.install import missing


class SourceError(ValueError):
    """The named run cannot be opened; the message says how to name one."""


def open_source(
    folder: str | None = None,
    *,
    address: str | None = None,
    run: str | None = None,
    run_dir: str | None = None,
    sim: str | None = None,
    sim_options: dict[str, Any] | None = None,
    poll: bool = True,
) -> RunSource:
    """Exactly one of ``folder``, ``address`` and ``sim``. A simulated run starts at once;
    a live one starts polling unless ``poll`` is False (a one-shot ``status``)."""
    given = [
        name for name, v in (("a run folder", folder), ("--address", address), ("--sim", sim)) if v
    ]
    if len(given) != 1:
        raise SourceError(
            "name one run: a run folder (e.g. runs/20250101-120000-eta3), --address of a Ray "
            f"cluster running staleflow launch, or --sim PRESET; got {' and '.join(given) or 'none'}"
        )
    if folder:
        try:
            return FolderSource(folder)
        except FolderError as exc:
            raise SourceError(str(exc)) from exc
    if sim:
        try:
            return SimSource.from_preset(sim, **(sim_options or {})).start()
        except ValueError as exc:
            raise SourceError(str(exc)) from exc
    try:
        source = RaySource.attach(str(address), run=run, run_dir=run_dir)
    except ImportError as exc:
        raise SourceError(missing("ray (to attach to a live run)", exc)) from exc
    except AttachError as exc:
        raise SourceError(str(exc)) from exc
    except (ConnectionError, ValueError) as exc:  # ValueError: an address with a bad port
        message = str(exc) if str(address) in str(exc) else f"at {address}: {exc}"
        raise SourceError(f"cannot reach a Ray cluster {message}") from exc
    if poll:
        return source.start()
    source.poll_once()
    return source
