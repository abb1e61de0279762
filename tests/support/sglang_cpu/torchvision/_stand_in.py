"""Stand-in for ``torchvision`` in CI's SGLang environment only (``.ci/sglang``).

The registry's torchvision is linked against CUDA torch and fails to import beside the
CPU build of torch ("operator torchvision::nms does not exist"), yet SGLang 0.5.23 imports
it at start-up for its vision-model configurations (``srt/configs/deepseek_ocr.py``,
``srt/multimodal/internvl_utils.py``), which a text-only Qwen2 server never runs. This
stand-in has the enums those modules and ``transformers``' image utilities read at import
(``InterpolationMode``, ``ImageReadMode``); every other name is a function that raises
when called, naming this package. ``torchvision.__version__`` says it is a stand-in.
"""

from __future__ import annotations

import enum
from typing import Any, NoReturn


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def absent(module: str, name: str) -> Any:
    """What a module of the stand-in returns for a name it does not have."""
    if name.startswith("__"):
        raise AttributeError(name)

    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"{module}.{name}: StaleFlow's stand-in for torchvision (tests/support/sglang_cpu, "
            "CI's SGLang environment, text models only) has no vision code: install torchvision"
        )

    call.__name__ = name
    return call
