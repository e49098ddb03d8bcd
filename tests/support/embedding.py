"""A stand-in for an embedding deployment's replica: it serves one request from the queue as a
replica would, each text's vector what the test says, without a model."""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.conf import settings

from gpuportal.wire.requestqueue import RequestQueue


class StandInEncoder(threading.Thread):
    """Serves the next request of `deployment`'s queue, `vector_of` each of its texts; `kinds`,
    the kinds of the requests it served."""

    def __init__(self, replica_id: str, deployment: str, vector_of: Callable[[str], list[float]], *, short_by: int = 0):
        super().__init__(daemon=True)
        self.replica_id, self.deployment, self.vector_of = replica_id, deployment, vector_of
        self.short_by = short_by  # vectors left out of its answer: a broken replica's
        self.queue = RequestQueue.from_url(settings.REDIS_URL)
        self.kinds: list[str] = []
        self.inputs: list[list[str]] = []

    def run(self) -> None:
        request = self.queue.take(self.deployment, self.replica_id, timeout=10)
        if request is None:
            return
        self.kinds.append(request.kind)
        self.inputs.append(request.input)
        self.queue.start(request.id, self.replica_id)
        tokens = sum(len(t) for t in request.input)
        output = {
            "embeddings": [self.vector_of(t) for t in request.input][: len(request.input) - self.short_by],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        self.queue.finish(request.id, self.replica_id, output)
