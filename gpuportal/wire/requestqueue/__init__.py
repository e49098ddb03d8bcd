"""Inference requests in Redis: one queue per deployment, taken by replicas as they have room.

Shared by the web process (submit, wait, read, cancel, re-queue) and the replica processes (take,
finish, fail), so it imports nothing of Django. The reliable-queue pattern keeps every accepted
request somewhere at every instant:

    gp:queue:<deployment>   ids waiting, oldest at the right end
    gp:proc:<replica>       ids a replica has taken (BLMOVE from the queue, atomically)
    gp:req:<id>             the request: status, timestamps, input, params, output or error
    gp:done:<id>            a token pushed when the request ends (its final fields), for waiters
    gp:stream:<id>          chunks of a streamed answer, in order, then an end marker
    gp:last:<replica>       when the replica last finished a request (for idle sleep)
    gp:proc:<replica>:stops the requests it holds that their callers asked to stop (id → why)
    gp:live:<deployment>:<family>  replicas taking requests now, scored by when that claim expires
    gp:deleted:<deployment>        a deployment deleted a moment ago, which no replica may claim
    gp:records              a compact record of every ended request, until the control plane drains it

A replica writes under its fences: its own written-off marker (gp:off:<replica>), its failover
pair's epoch (gp:epoch:<fence>) and its node's epoch and lease (gp:node:<node>:epoch, :lease;
gpuportal.wire.node_lease).

A replica that dies leaves its ids in gp:proc:<replica>; `requeue_from` puts them back at the
head of the queue (or fails them once they used their attempts).
"""

from __future__ import annotations

from gpuportal.wire.requestqueue.oversight import Overseeing
from gpuportal.wire.requestqueue.protocol import (
    BAD_INPUT,
    BLOCK_SLICE_S,
    CALLERS_INPUT,
    COUNT_KIND,
    DELETED_TTL_S,
    FAMILIES,
    FINAL,
    LIVE_TTL_S,
    RECORDS_KEY,
    RECORDS_MAX,
    REQUEST_PREFIX,
    STOPPED,
    STREAM_END,
    STREAM_PICKS,
    STREAM_RESTART,
    TOO_LONG,
    TTL_S,
    Fence,
    Fenced,
    KeyTakenOver,
    LeaseLapsed,
    NodeWrittenOff,
    NotTaken,
    Request,
    StaleEpoch,
    StreamSplice,
    SubmitTooLate,
    WrittenOff,
    deleted_key,
    done_key,
    epoch_key,
    family_of_kind,
    family_of_loader,
    finished_key,
    index_keys,
    last_key,
    live_key,
    never_sent,
    now,
    picked_piece,
    processing_key,
    queue_key,
    read_piece,
    records_key,
    request_key,
    stops_key,
    stream_bell_key,
    stream_key,
    stream_readers_key,
    written_off_key,
)
from gpuportal.wire.requestqueue.serving import Serving
from gpuportal.wire.requestqueue.web import Submitting


class RequestQueue(Submitting, Overseeing, Serving):
    """The queue as one client of Redis: the web's, the control plane's and a replica's sides
    (web.py, oversight.py, serving.py) in one object: each side uses the methods of its own file."""


__all__ = [
    "BAD_INPUT",
    "BLOCK_SLICE_S",
    "CALLERS_INPUT",
    "COUNT_KIND",
    "DELETED_TTL_S",
    "FAMILIES",
    "FINAL",
    "LIVE_TTL_S",
    "RECORDS_KEY",
    "RECORDS_MAX",
    "REQUEST_PREFIX",
    "STOPPED",
    "STREAM_END",
    "STREAM_PICKS",
    "STREAM_RESTART",
    "TOO_LONG",
    "TTL_S",
    "Fence",
    "Fenced",
    "KeyTakenOver",
    "LeaseLapsed",
    "NodeWrittenOff",
    "NotTaken",
    "Request",
    "RequestQueue",
    "StaleEpoch",
    "StreamSplice",
    "SubmitTooLate",
    "WrittenOff",
    "deleted_key",
    "done_key",
    "epoch_key",
    "family_of_kind",
    "family_of_loader",
    "finished_key",
    "index_keys",
    "last_key",
    "live_key",
    "never_sent",
    "now",
    "picked_piece",
    "processing_key",
    "queue_key",
    "read_piece",
    "records_key",
    "request_key",
    "stops_key",
    "stream_bell_key",
    "stream_key",
    "stream_readers_key",
    "written_off_key",
]
