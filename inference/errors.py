"""Errors the data plane's serving modules share (serving and batching both raise them)."""


class BadInput(Exception):
    """The request cannot run on this model as sent (too long, wrong shape): the client's to fix."""
