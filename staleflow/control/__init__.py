"""The control loop shared by the real control plane and the simulator (``loop``), the
decisions it takes (``decisions``) and trajectory-server writes that tolerate late
messages (``late``). Pure Python: importing it imports no ray, torch or engine."""

from staleflow.control.decisions import Consumed, Decision, Dropped, Issued, Occupied
from staleflow.control.loop import ControlLoop, FinishedLike, Planes, TrajectoryStore

__all__ = [
    "Consumed",
    "ControlLoop",
    "Decision",
    "Dropped",
    "FinishedLike",
    "Issued",
    "Occupied",
    "Planes",
    "TrajectoryStore",
]
