"""Part of StaleFlow's stand-in for torchvision (see ``torchvision/_stand_in.py``)."""

from __future__ import annotations

from typing import Any

from torchvision._stand_in import InterpolationMode, absent  # noqa: F401


def __getattr__(name: str) -> Any:
    return absent(__name__, name)
