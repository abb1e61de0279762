"""FAKE SGLang LoRA serving, for tests only: the adapter endpoints of the fake server
(``tests/support/fake_sglang.py``) when it runs with ``--enable-lora``.

It reproduces the HTTP contract of **SGLang 0.5.23** that ``staleflow.engines.sglang``
uses with LoRA (``python/sglang/srt/``):

* ``POST /load_lora_adapter {lora_name, lora_path}`` (``entrypoints/http_server.py:1652``)
  reads a PEFT folder; it fails (400, ``success: false``) when LoRA is not enabled
  (``managers/tokenizer_control_mixin.py:667``), when the name is loaded already
  (``lora/lora_manager.py:357``), when the adapter's rank is above ``--max-lora-rank`` or
  it targets a module outside ``--lora-target-modules`` (``:371``), and, here, when it
  would hold more than ``--max-loaded-loras`` (real SGLang evicts the least recently used);
* ``/generate`` with ``lora_path`` naming an adapter that is not loaded fails
  (``lora/lora_registry.py:139``);
* ``POST /unload_lora_adapter {lora_name}`` (``http_server.py:1676``) of a name not loaded
  fails; real SGLang waits until no request uses the adapter (``lora_registry``
  ``wait_for_unload``, ``tokenizer_control_mixin.py:651``): the fake refuses (409) rather
  than stall, so an adapter that unloads an adapter its requests still use is caught.

What it fakes: SGLang's LoRA memory pool and its batched multi-adapter kernels. The fake
has one set of peft LoRA layers (rank ``--max-lora-rank``, each adapter's ``alpha / r``
folded into its ``B``, padded with zeros), so requests of two adapters cannot be in flight
at once here (refused; real SGLang batches them); a request of another adapter finds the
layers switched to it once none of the previous one's is in flight. A request without
``lora_path`` runs on the base (zero adapter).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from tests.support.fake_sglang import HTTPFailure


class FakeLoRA:
    """The adapters of one fake server; its model gets the LoRA layers at construction."""

    def __init__(
        self, model: torch.nn.Module, max_rank: int, targets: Collection[str], max_loaded: int = 2
    ) -> None:
        from staleflow.config.lora import LoraConfig
        from staleflow.models.lora import add_adapters

        # scaling 1: an adapter's own alpha / r goes into its B when it is loaded
        config = LoraConfig(
            enabled=True, rank=max_rank, alpha=float(max_rank), target_modules=",".join(targets)
        )
        add_adapters(model, config)
        self.max_rank = max_rank
        self.targets = set(targets)
        self.max_loaded = max_loaded
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}
        self.active: str | None = None  # whose matrices the layers hold; None: zeros (base)

    def load(self, body: dict[str, Any], shapes: dict[str, tuple[tuple[int, ...], str]]) -> Any:
        from safetensors.torch import load_file

        name, path = body.get("lora_name"), Path(str(body.get("lora_path")))
        if name in self.loaded:
            raise HTTPFailure(
                400, f"Failed to load LoRA adapter {name} because it is already loaded"
            )
        if len(self.loaded) >= self.max_loaded:
            raise HTTPFailure(
                400,
                f"fake: {len(self.loaded)} adapters loaded, --max-loaded-loras is {self.max_loaded}",
            )
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            tensors = load_file(str(path / "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            raise HTTPFailure(400, f"fake: cannot read the adapter at {path}: {exc}") from exc
        r, alpha = int(config["r"]), float(config["lora_alpha"])
        if r > self.max_rank or not set(config["target_modules"]) <= self.targets:
            raise HTTPFailure(
                400,
                f"LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory "
                "pool configuration. Please ensure that the LoRA adapter's rank is within the "
                "configured `--max-lora-rank` and that the target modules are included in "
                "`--lora-target-modules`.",
            )
        padded = {k: torch.zeros(shape) for k, (shape, _) in shapes.items()}
        for key, value in tensors.items():
            if key not in padded:
                raise HTTPFailure(400, f"fake: adapter {name} has a tensor {key} the model lacks")
            if ".lora_A." in key:
                padded[key][:r] = value
            else:
                padded[key][:, :r] = value * (alpha / r)
        self.loaded[name] = padded
        return {
            "success": True,
            "error_message": None,
            "loaded_adapters": {n: n for n in self.loaded},
        }

    def unload(self, body: dict[str, Any], in_use: Collection[str | None]) -> Any:
        name = body.get("lora_name")
        if name not in self.loaded:
            raise HTTPFailure(400, f"LoRA adapter {name} is not loaded")
        if name in in_use:
            raise HTTPFailure(
                409,
                f"fake: requests using LoRA adapter {name} are in flight; real SGLang would "
                "wait for them to finish before unloading it (wait_for_unload)",
            )
        del self.loaded[name]
        return {
            "success": True,
            "error_message": None,
            "loaded_adapters": {n: n for n in self.loaded},
        }

    def switch(
        self,
        name: str | None,
        in_use: Collection[str | None],
        shapes: dict[str, tuple[tuple[int, ...], str]],
    ) -> dict[str, Any] | None:
        """The matrices the layers must hold for a request of ``name`` (None when they
        hold them already); refused while requests of another adapter are in flight."""
        if name is not None and name not in self.loaded:
            raise HTTPFailure(400, f"The following requested LoRA adapters are not loaded: {name}")
        if name == self.active:
            return None
        if set(in_use) - {name}:
            raise HTTPFailure(
                400,
                "fake: requests of another LoRA adapter are in flight; the fake has one set of "
                "LoRA layers (real SGLang batches several adapters)",
            )
        self.active = name
        if name is None:
            return {k: torch.zeros(shape) for k, (shape, _) in shapes.items()}
        return self.loaded[name]


def lora_route(server: Any, route: str, body: dict[str, Any]) -> Any:
    """``server``'s (a ``FakeSGLangServer``) LoRA routes: ``load``, ``unload``, and ``use``
    (a ``/generate`` naming ``lora_path``, already under the server's lock)."""
    lora: FakeLoRA | None = server.lora
    if lora is None:
        if route == "use" and body.get("lora_path") is None:
            return None
        raise HTTPFailure(400, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    shapes = server.engine.weight_shapes()
    if route == "use":
        in_use = {g.lora for g in server._gens.values()}
        weights = lora.switch(body.get("lora_path"), in_use, shapes)
        if weights is not None:
            version = next(server._next_version)
            server.engine.load_weights(weights, version)
            server._version_labels[version] = server.weight_version
        return None
    with server._lock:
        if route == "load":
            return lora.load(body, shapes)
        return lora.unload(body, {g.lora for g in server._gens.values()})
