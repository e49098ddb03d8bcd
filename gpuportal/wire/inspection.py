"""Reading a model's sizes from its files: asked of a node, never done in the web
process. The files live where the replicas load them, on the nodes; and a `torch-module` source
is code, which must run in no process that serves the API. Django-free.

The control plane sends an InspectModel to one online node's own queue and waits on `reply_to`
(gpuportal.wire.replies) for a ModelReading. Not a queue every node consumes: a queue a node
reads from is one it may write to, and a node's worker must take a question (for a torch-module
source, code it imports and runs) from the control plane alone."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gpuportal.wire.commands import VERSION, WireError, decode_as
from gpuportal.wire.memory import ModelShape

INSPECT_TASK = "inference.tasks.inspect_model"


@dataclass(frozen=True)
class InspectModel:
    source: str
    loader: str
    dtype: str
    reply_to: str
    # The deployment's LoRA adapters (gpuportal.wire.adapters), whose sizes are read too.
    adapters: str = ""

    def encode(self) -> dict[str, Any]:
        return {"v": VERSION, **asdict(self)}

    @classmethod
    def decode(cls, payload: Any) -> InspectModel:
        return decode_as(cls, payload, "an inspection")


@dataclass(frozen=True)
class ModelReading:
    """What a node read: the weights' bytes, and for a transformers model its shape (which the
    control plane's estimate needs), and what its adapters' stacks take beside them; `refusal`
    says why the source cannot be served (its files are missing, or it is not a model), for a
    400 naming `refused` (`model.source`, or `model.adapters` for an adapter's)."""

    weight_bytes: int = 0
    shape: ModelShape | None = None
    refusal: str = ""
    adapter_bytes: int = 0
    refused: str = "model.source"

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> ModelReading:
        try:
            shape = record.get("shape")
            return cls(
                weight_bytes=int(record.get("weight_bytes", 0)),
                shape=ModelShape(**shape) if shape else None,
                refusal=str(record.get("refusal", "")),
                adapter_bytes=int(record.get("adapter_bytes", 0)),
                refused=str(record.get("refused", "model.source")),
            )
        except (TypeError, ValueError) as err:
            raise WireError(f"a model reading with bad fields: {err}") from None
