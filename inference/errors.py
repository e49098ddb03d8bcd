"""Errors the data plane's serving modules share (serving and batching both raise them)."""

from gpuportal.wire.requestqueue import BAD_INPUT, TOO_LONG


class BadInput(Exception):
    """The request cannot run on this model as sent (too long, wrong shape): the client's to fix."""

    kind = BAD_INPUT


class TooLong(BadInput):
    """The prompt plus max_tokens exceed the model's context or the replica's KV cache."""

    kind = TOO_LONG
