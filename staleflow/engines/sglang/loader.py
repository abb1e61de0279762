"""Pulling a version from the parameter server inside SGLang's TP workers.

SGLang 0.5.23 ``/update_weights_from_tensor`` (``srt/entrypoints/http_server.py:1436``,
body ``UpdateWeightsFromTensorReqInput``, ``srt/managers/io_struct.py:2027``) carries one
``MultiprocessingSerializer`` payload per TP rank; each rank deserialises its own
(``srt/managers/tp_worker.py:194``) with ``SafeUnpickler`` (``srt/utils/common.py:3144``),
and when ``load_format`` is an import path listed in ``--custom-weight-loader``, calls
``loader(model, named_tensors)`` (``srt/model_executor/model_runner_components/
weight_updater.py:374``). We send a *ticket* instead of weights: one entry whose name
holds the PS endpoint, layout and version (JSON) and whose tensor is empty. An empty CPU
tensor is the one tensor ``ForkingPickler`` serialises without shared memory
(``rebuild_storage_empty``), and every global it needs is on SafeUnpickler's allow list.

:func:`load_from_parameter_server` then runs in every TP worker: it pulls that version
from the PS (shared memory from the node's replica, or the socket) and hands the Hugging
Face-named tensors to the model's own ``load_weights``, which keeps this rank's shard.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from parameter_server import Layout
from parameter_server.transport import connect
from parameter_server.transport.base import Endpoint

if TYPE_CHECKING:
    import torch


class LoadsWeights(Protocol):
    """What the loader needs of SGLang's model: its Hugging Face-named ``load_weights``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


TICKET_PREFIX = "staleflow-ps-ticket:"
LOADER_PATH = "staleflow.engines.sglang.loader.load_from_parameter_server"


@dataclasses.dataclass(frozen=True, slots=True)
class PullTicket:
    """Where and what to pull: a PS endpoint (``Endpoint`` fields), its transport and
    layout (``Layout.to_dict()``), and the version."""

    endpoint: dict[str, str]
    transport: str
    layout: dict[str, Any]
    version: int

    def encode(self) -> str:
        return TICKET_PREFIX + json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, name: str) -> PullTicket:
        if not name.startswith(TICKET_PREFIX):
            raise ValueError(f"not a StaleFlow pull ticket: {name[:40]!r}")
        return cls(**json.loads(name[len(TICKET_PREFIX) :]))


def ticket_payloads(ticket: PullTicket, tp_size: int) -> list[str]:
    """``serialized_named_tensors``: the same ticket for each TP rank, base64 text (JSON
    has no bytes; ``io_struct.py`` decodes ``Base64Bytes``)."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing

    buf = io.BytesIO()
    ForkingPickler(buf).dump([(ticket.encode(), torch.empty(0, dtype=torch.uint8))])
    text = base64.b64encode(buf.getvalue()).decode("ascii")
    return [text] * tp_size


def load_from_parameter_server(
    model: LoadsWeights, named_tensors: Iterable[tuple[str, Any]]
) -> None:
    """SGLang custom weight loader: pull the ticket's version and load it into ``model``."""
    tickets = [PullTicket.decode(name) for name, _ in named_tensors]
    if len(tickets) != 1:
        raise ValueError(f"expected one StaleFlow pull ticket, got {len(tickets)}")
    model.load_weights(list(pull_named_tensors(tickets[0])))


def pull_named_tensors(ticket: PullTicket) -> Iterable[tuple[str, Any]]:
    """The ticket's version from the PS as (name, CPU tensor) pairs."""
    import numpy as np
    import torch

    layout = Layout.from_dict(ticket.layout)
    buffer = np.empty(layout.nbytes, dtype=np.uint8)
    with connect(Endpoint(**ticket.endpoint), ticket.transport) as client:
        got = client.pull(buffer, ticket.version)
    if got != ticket.version:
        raise RuntimeError(f"asked the PS for version {ticket.version}, got {got}")
    for name, view in layout.views(buffer).items():
        if view.dtype == np.uint16:  # bfloat16 travels as its bit pattern
            yield name, torch.from_numpy(view.view(np.int16).copy()).view(torch.bfloat16)
        else:
            yield name, torch.from_numpy(view.copy())
