"""Reward functions that misbehave on purpose, for the time-limit tests.

Imported by name in a spawned child process (``reward_helpers:make_...``): the tests put
this folder on ``sys.path``, which the child inherits.
"""

from __future__ import annotations

import os
import time


def misbehaving(response_text: str, answer: str) -> float:
    if response_text == "hang":
        time.sleep(120)
    if response_text == "crash":
        os._exit(3)
    if response_text == "boom":
        raise ValueError("boom")
    if response_text == "junk":
        return "yes"  # type: ignore[return-value]
    return 1.0 if response_text == answer else 0.0


def make_misbehaving():
    return misbehaving


def make_unbuildable():
    raise ImportError("No module named 'imaginary'")
