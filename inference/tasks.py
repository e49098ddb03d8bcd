"""Tasks that run on a node agent's own queue (`node.<name>`): each carries one command of
gpuportal.wire.commands, carried out on this host's replica processes through the agent's
supervisor. What the processes report goes back through the agent's gateway to the control plane."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from dataclasses import replace
from typing import Any, TypeVar

import redis
from celery import shared_task
from django.conf import settings

from gpuportal.wire import commands, replies
from gpuportal.wire.commands import DeepenReplica, KeepArena, SleepReplica, StartReplica, StopReplica, WakeReplica
from gpuportal.wire.inspection import INSPECT_TASK, InspectModel
from gpuportal.wire.pulls import PULL_TASK, PULL_TTL_S, PullModel, PullProgress
from gpuportal.wire.replica_logs import LOG_TASK, MAX_LOG_BYTES, ReadLog, last_lines, whole_lines
from gpuportal.wire.states import ReplicaState as S
from inference import agent
from inference.inspection import read_model

log = logging.getLogger(__name__)

C = TypeVar("C", StartReplica, SleepReplica, WakeReplica, StopReplica, KeepArena, DeepenReplica)

# What a sleeping victim may still hold on a GPU beyond what it said it keeps (its CUDA context
# is in that; this covers the allocator's rounding) before the waker stops waiting for it.
NVML_SLACK_BYTES = 64 * 1024**2


@shared_task(name="inference.tasks.describe_node")
def describe_node(name: str) -> dict:
    """What the agent consuming this node's queue sees: proves the queue reaches the right host."""
    current = agent.current()
    return {
        "node": current.name,
        "asked_for": name,
        "hostname": socket.gethostname(),
        "gpus": [{"index": d.index, "uuid": d.uuid, "total_bytes": d.total_bytes} for d in current.devices],
    }


def wait_released(
    replica_ids: list[str], gpus: list[int], *, virtual: bool, whole: bool = False, timeout: float | None = None
) -> list[str]:
    """Wait until replicas evicted to make room have let go of their GPU memory; returns those
    that had not when the timeout passed (loading then proceeds and may fail like an OOM).

    They run here (they share this node's GPUs), so their own processes say when: each has said
    it sleeps, or has exited. On a real GPU NVML must also no longer show a sleeper holding more
    on `gpus` (the waker's) than what it said it keeps: a process that says it moved its weights
    but whose memory the driver has not freed yet is still in the way. `whole`: the waker takes
    `gpus` whole, which leaves no room for a sleeper's CUDA context there; such a sleeper sleeps
    deeply (the control plane tells it, as its sleep report finds the room gone:
    scheduling.services.replica_reports), and the waker waits for its process's exit rather than
    load beside a context its GPUs no longer have room for.
    """
    supervisor = agent.supervisor()
    deadline = time.monotonic() + (settings.GPUPORTAL_EVICTION_WAIT_S if timeout is None else timeout)
    pending = supervisor.released(replica_ids, timeout=max(0.0, deadline - time.monotonic()))
    if not pending and whole:
        on_gpus = {str(g) for g in gpus}
        asleep = supervisor.sleepers(replica_ids)
        in_the_way = [rid for rid, (_, keeps) in asleep.items() if any(keeps.get(g) for g in on_gpus)]
        pending = supervisor.exited(in_the_way, timeout=max(0.0, deadline - time.monotonic()))
    if pending or virtual:
        return pending
    while True:
        sleepers = supervisor.sleepers(replica_ids)
        pending = [rid for rid, (pid, keeps) in sleepers.items() if still_holding(pid, keeps, gpus)]
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.05)  # the driver frees memory on its own time; NVML is all there is to ask


def still_holding(pid: int, keeps: dict[str, int], gpus: list[int]) -> bool:
    from inference.backends import nvml_process_bytes

    measured = nvml_process_bytes(pid)
    if measured is None:  # no NVML here: the process's word is all there is
        return False
    return any(measured.get(str(g), 0) > keeps.get(str(g), 0) + NVML_SLACK_BYTES for g in gpus)


def _still_wanted(replica_id: str, state: str) -> str | None:
    """Why a command that waited in the queue is no longer wanted (None: it is)."""
    found = agent.current().control.replica_state(replica_id)
    return None if found == state else f"skipped: replica is {found or 'gone'}"


def _read(payload: Any, kind: type[C]) -> C:
    command = commands.decode(payload)
    if not isinstance(command, kind):
        raise commands.WireError(f"a {command.kind} command sent to the {kind.kind} task")
    return command


def _answers() -> redis.Redis:
    return replies.client(settings.REDIS_URL)


# Acknowledged on receipt, like the agents' calls: its asker waits only so long.
@shared_task(name=INSPECT_TASK, ignore_result=True, acks_late=False)
def inspect_model(payload: dict) -> str:
    """Reads a model's sizes from its files for the control plane, which waits on reply_to."""
    ask = InspectModel.decode(payload)
    try:
        reading = read_model(ask.source, ask.loader, ask.dtype, ask.adapters)
    except Exception as err:
        # Answered all the same: the deploy waiting on it says what went wrong at once, rather
        # than a 503 once its wait is over.
        log.exception("could not read %s", ask.source)
        replies.answer(_answers(), ask.reply_to, error=f"{type(err).__name__}: {err}")
        return f"failed: {err}"
    replies.answer(_answers(), ask.reply_to, result=reading.record())
    return f"refused: {reading.refusal}" if reading.refusal else f"read {ask.source}"


# On the node's own queue (its cache is its own); acknowledged on receipt: an agent that dies in
# the middle leaves the pull to be asked again, which resumes where the download stopped.
@shared_task(name=PULL_TASK, ignore_result=True, acks_late=False)
def pull_model(payload: dict) -> str:
    """Fetches a Hugging Face model into this node's cache, writing its progress where the
    control plane reads it (gpuportal.wire.pulls)."""
    from inference.pull import pull

    ask = PullModel.decode(payload)
    client = _answers()

    def report(progress: PullProgress) -> None:
        try:
            client.set(ask.progress_key, json.dumps(progress.record()), ex=PULL_TTL_S)
        except redis.RedisError as err:  # the pull goes on; the next report may get through
            log.warning("could not report the pull of %s: %s", ask.repo, err)

    final = pull(ask.repo, ask.revision, report)
    return f"{final.state}: {final.path or final.error}"


# On the node's own queue (only its agent has the file); acknowledged on receipt, like inspection.
@shared_task(name=LOG_TASK, ignore_result=True, acks_late=False)
def replica_log(payload: dict) -> str:
    """The last lines of a replica's log file on this node, or those written since an offset,
    for the control plane on reply_to; `end` is where the next read goes on from."""
    ask = ReadLog.decode(payload)
    path = agent.supervisor().log_path(ask.replica_id)
    try:
        with path.open("rb") as log_file:
            size = log_file.seek(0, 2)
            end, skipped = size, 0
            if ask.since is None:
                log_file.seek(max(0, size - MAX_LOG_BYTES))
                lines = last_lines(log_file.read().decode(errors="replace"), ask.tail)
            else:
                # Shorter than where the follower was: a new file (the replica started anew).
                since = ask.since if ask.since <= size else 0
                # At most MAX_LOG_BYTES an answer, as for a tail: a follower far behind skips.
                start = max(since, size - MAX_LOG_BYTES)
                log_file.seek(start)
                lines, end = whole_lines(log_file.read(size - start), start)
                skipped = start - since
    except FileNotFoundError:
        replies.answer(
            _answers(), ask.reply_to, result={"path": str(path), "lines": [], "missing": True, "end": 0, "skipped": 0}
        )
        return f"no log for {ask.replica_id}"
    result = {"path": str(path), "lines": lines, "missing": False, "end": end, "skipped": skipped}
    replies.answer(_answers(), ask.reply_to, result=result)
    return f"{len(lines)} line(s) of {ask.replica_id}"


@shared_task(name="inference.tasks.start_replica")
def start_replica(payload: dict) -> str:
    command = _read(payload, StartReplica)
    # A wake from deep sleep is a start too: of a replica the books have waking, not pending.
    if skipped := _still_wanted(command.replica_id, S.WAKING if command.spec.from_host_copy else S.PENDING):
        return skipped
    spec = command.spec
    whole = spec.fraction is None
    if late := wait_released(list(command.wait_for), list(spec.gpus), virtual=spec.backend == "virtual", whole=whole):
        log.warning("replica %s starts while %s still hold memory", spec.replica_id, ", ".join(late))
    current = agent.current()
    local = replace(spec, redis_url=settings.REDIS_URL)  # what only this host knows: how it reaches Redis
    running = spec.replica_id in current.supervisor.running()
    if running and spec.from_host_copy:
        # A deep wake sent again (its report was lost): the process it started says where it is.
        with contextlib.suppress(KeyError, ProcessLookupError):
            current.supervisor.send(spec.replica_id, {"cmd": "resync"})
        return "running"
    if running:
        current.supervisor.stop(spec.replica_id)  # a restart (e.g. after a CUDA assert): a fresh process
    current.start(local)
    return "started"


@shared_task(name="inference.tasks.replica_to_cache")
def replica_to_cache(payload: dict) -> str:
    command = _read(payload, SleepReplica)
    # A sleep sent again (scheduling.services.lost_commands) may find the first one done: the replica
    # asleep, or parked since (its process stopped), which a sleep must not report as a crash.
    if skipped := _still_wanted(command.replica_id, S.DRAINING):
        return skipped
    sent: dict[str, Any] = {"cmd": "sleep"}
    if command.drain_timeout_s is not None:
        sent["drain_timeout_s"] = command.drain_timeout_s
    return _command(command.replica_id, sent)


@shared_task(name="inference.tasks.replica_from_cache")
def replica_from_cache(payload: dict) -> str:
    command = _read(payload, WakeReplica)
    if skipped := _still_wanted(command.replica_id, S.WAKING):
        return skipped
    backend = agent.current().supervisor.backend_of(command.replica_id)
    wait_released(list(command.wait_for), list(command.gpus), virtual=backend != "cuda", whole=command.fraction is None)
    sent = {
        "cmd": "wake",
        "gpus": list(command.gpus),
        "reserved_bytes_by_gpu": dict(command.reserved_bytes_by_gpu),
        "fraction": command.fraction,
    }
    return _command(command.replica_id, sent)


@shared_task(name="inference.tasks.stop_replica")
def stop_replica(payload: dict) -> str:
    command = _read(payload, StopReplica)
    current = agent.current()
    if command.replica_id in current.supervisor.running():
        # Drains first: the request in flight finishes or goes back to its queue (scale-down loses nothing).
        current.supervisor.stop(
            command.replica_id, drain_timeout_s=command.drain_timeout_s, close_pair=command.close_pair
        )
        return "stopped"
    # No process: stopped already, or deep asleep, whose weights wait in the node's host copy.
    current.supervisor.forget_host_copy(command.replica_id)
    current.relay(command.replica_id, {"event": "stopped"})
    return "not running here"


@shared_task(name="inference.tasks.replica_arena")
def replica_arena(payload: dict) -> str:
    """Whether the replica may keep a host arena while awake: told to its process,
    which answers with an `arena` event once it holds one ready, or has dropped it."""
    command = _read(payload, KeepArena)
    # No process: the replica stopped or died since the control plane decided. Its death is
    # reported by whatever waits on it; an arena for a process that is gone is no failure.
    return _command(command.replica_id, {"cmd": "arena", "keep": command.keep}, gone_is_crash=False)


@shared_task(name="inference.tasks.replica_deepen")
def replica_deepen(payload: dict) -> str:
    """Sleep deeply (gpuportal.wire.commands.DeepenReplica): the sleeper writes its weights to the
    node's host copy, says `deep_sleeping` and exits."""
    command = _read(payload, DeepenReplica)
    if skipped := _still_wanted(command.replica_id, S.SLEEPING):
        return skipped
    path = agent.current().supervisor.host_copy_path(command.replica_id)
    # No process: it wrote its copy and exited after a first deepen (its report is on its way),
    # or it died, which its reader reports. Not a crash to report from here.
    return _command(command.replica_id, {"cmd": "deepen", "path": str(path)}, gone_is_crash=False)


def _command(replica_id: str, command: dict, *, gone_is_crash: bool = True) -> str:
    current = agent.current()
    try:
        current.supervisor.send(replica_id, command)
    except (KeyError, ProcessLookupError):
        if gone_is_crash:
            # The process is gone (the agent restarted, or it died unnoticed): say so rather than wait.
            reason = f"no process for this replica on {current.name}"
            current.relay(replica_id, {"event": "failed", "kind": "crash", "reason": reason})
        return "no process"
    return "sent"
