"""Tasks that run on a node agent's own queue (`node.<name>`): they drive this host's replica
processes through the agent's supervisor, and relay what the processes report to the services."""

from __future__ import annotations

import logging
import socket
import time

from celery import shared_task
from django.conf import settings
from django.db import connection

from inference import agent
from inference.relay import relay
from inference.supervisor import ReplicaSpec
from scheduling.models import GPU, Node, Replica

log = logging.getLogger(__name__)

# States in which an evicted replica still holds its GPU memory.
HOLDING = (Replica.State.SERVING, Replica.State.DRAINING)


@shared_task(name="inference.tasks.describe_node")
def describe_node(name: str) -> dict:
    """What the agent consuming this node's queue sees: proves the queue reaches the right host."""
    node = Node.objects.prefetch_related("gpus").get(name=name)
    return {
        "node": node.name,
        "hostname": socket.gethostname(),
        "gpus": [{"index": g.index, "uuid": g.uuid, "total_bytes": g.total_bytes} for g in node.gpus.all()],
    }


# What a sleeping victim may still hold on a GPU beyond its reservation (its CUDA context is in
# the reservation; this covers the allocator's rounding) before the waker stops waiting for it.
NVML_SLACK_BYTES = 64 * 1024**2


def wait_released(replica_ids: list[str], timeout: float | None = None, gpus: list[int] | None = None) -> list[str]:
    """Wait until replicas evicted to make room have let go of their GPU memory; returns those
    that had not when the timeout passed (loading then proceeds and may fail like an OOM).

    Let go twice over: their reservation is released through the commit path (their process
    reported `sleeping` or ended), and, on a real GPU, NVML no longer shows their process
    holding more on `gpus` (the waker's) than what they still reserve there: a process that
    says it moved its weights but whose memory the driver has not freed yet is still in the way.
    """
    deadline = time.monotonic() + (settings.GPUPORTAL_EVICTION_WAIT_S if timeout is None else timeout)
    pending = list(replica_ids)
    while pending:
        pending = list(Replica.objects.filter(pk__in=pending, state__in=HOLDING).values_list("pk", flat=True))
        if not pending or time.monotonic() > deadline:
            break
        # The victim's agent reports through PostgreSQL; there is nothing else to block on.
        time.sleep(0.2)
    if pending:
        return pending
    while True:
        pending = [r.id for r in _on_real_gpus(replica_ids) if _still_holding(r, gpus)]
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.2)  # the driver frees memory on its own time; NVML is all there is to ask


def _on_real_gpus(replica_ids: list[str]) -> list[Replica]:
    return list(Replica.objects.filter(pk__in=replica_ids, node__virtual=False, pid__isnull=False))


def _still_holding(replica: Replica, gpus: list[int] | None) -> bool:
    from inference.replica import nvml_process_bytes

    measured = nvml_process_bytes(replica.pid)
    if measured is None:  # no NVML here: the commit path's word is all there is
        return False
    reserved = {str(k): int(v) for k, v in (replica.gpu_mem_bytes_by_id or {}).items()}
    watched = [str(g) for g in gpus] if gpus is not None else list(measured)
    return any(measured.get(g, 0) > reserved.get(g, 0) + NVML_SLACK_BYTES for g in watched)


def database_dsn() -> str:
    """A libpq URL of this process's database, for a failover member's own lock connection."""
    from urllib.parse import quote

    s = connection.settings_dict
    auth = quote(s["USER"] or "", safe="") + (f":{quote(s['PASSWORD'], safe='')}" if s["PASSWORD"] else "")
    return f"postgresql://{auth}@{s['HOST'] or 'localhost'}:{s['PORT'] or 5432}/{quote(s['NAME'], safe='')}"


def failover_fields(replica: Replica) -> dict:
    if replica.lease_id is None:
        return {}
    return {
        "failover_lease": replica.lease_id,
        "failover_fence": replica.lease.fence,
        "role": replica.role,
        "failover_dsn": database_dsn(),
        "reconnect_window_s": settings.GPUPORTAL_FAILOVER_RECONNECT_WINDOW_S,
        "wake_timeout_s": settings.GPUPORTAL_FAILOVER_WAKE_TIMEOUT_S,
        "liveness_timeout_s": settings.GPUPORTAL_FAILOVER_LIVENESS_TIMEOUT_S,
    }


def contexts_for(replica: Replica) -> tuple[int, int]:
    """(serving context, standby context) the replica's reservation counts: its GPUs' own, the
    largest of them, as the scheduler counted them (scheduling.services.deployments.need_bytes)."""
    from scheduling.services.deployments import contexts_of

    indices = [int(index) for index in replica.gpu_mem_bytes_by_id]
    return contexts_of(GPU.objects.filter(node_id=replica.node_id, index__in=indices))


def spec_for(replica: Replica) -> ReplicaSpec:
    deployment = replica.deployment
    context, standby_context = contexts_for(replica)
    return ReplicaSpec(
        replica_id=replica.id,
        source=deployment.model_source,
        loader=deployment.loader,
        dtype=deployment.dtype,
        gpus=tuple(sorted(int(index) for index in replica.gpu_mem_bytes_by_id)),
        reserved_bytes_by_gpu={str(k): int(v) for k, v in replica.gpu_mem_bytes_by_id.items()},
        fraction=replica.gpu_memory_fraction,
        backend="virtual" if replica.node.virtual else "cuda",
        deployment=deployment.name,
        redis_url=settings.REDIS_URL,
        kv_max_tokens=deployment.max_tokens,
        # The reservation counts one CUDA context, and a pair's the standby's too (need_bytes).
        context_bytes=context,
        standby_context_bytes=standby_context if replica.lease_id is not None else 0,
        # A failover member dies with its agent as before: its liveness watchdog lives there.
        adoption_window_s=settings.GPUPORTAL_ADOPTION_WINDOW_S if replica.lease_id is None else 0.0,
        **failover_fields(replica),
    )


@shared_task(name="inference.tasks.start_replica")
def start_replica(replica_id: str, wait_for: list[str]) -> str:
    replica = Replica.objects.select_related("deployment", "node", "lease").filter(pk=replica_id).first()
    if replica is None or replica.state != Replica.State.PENDING:
        return f"skipped: replica is {replica.state if replica else 'gone'}"
    if late := wait_released(wait_for, gpus=sorted(int(g) for g in replica.gpu_mem_bytes_by_id)):
        log.warning("replica %s starts while %s still hold memory", replica_id, ", ".join(late))
    supervisor = agent.supervisor()
    if replica_id in supervisor.running():
        supervisor.stop(replica_id)  # a restart (e.g. after a CUDA assert): a fresh process
    supervisor.start(spec_for(replica), on_event=relay)
    return "started"


def drain_timeout_of(replica_id: str) -> float | None:
    """The replica's deployment's drain_timeout_s (the barrier of issue 5); None if the row is gone."""
    return Replica.objects.filter(pk=replica_id).values_list("deployment__drain_timeout_s", flat=True).first()


@shared_task(name="inference.tasks.replica_to_cache")
def replica_to_cache(replica_id: str) -> str:
    command: dict = {"cmd": "sleep"}
    if (drain := drain_timeout_of(replica_id)) is not None:
        command["drain_timeout_s"] = drain
    return _command(replica_id, command)


@shared_task(name="inference.tasks.replica_from_cache")
def replica_from_cache(replica_id: str, wait_for: list[str]) -> str:
    replica = Replica.objects.select_related("node").filter(pk=replica_id).first()
    if replica is None or replica.state != Replica.State.WAKING:
        return f"skipped: replica is {replica.state if replica else 'gone'}"
    mapping = {str(k): int(v) for k, v in replica.gpu_mem_bytes_by_id.items()}
    wait_released(wait_for, gpus=sorted(int(k) for k in mapping))
    command = {
        "cmd": "wake",
        "gpus": sorted(int(k) for k in mapping),
        "reserved_bytes_by_gpu": mapping,
        "fraction": replica.gpu_memory_fraction,
    }
    return _command(replica_id, command)


@shared_task(name="inference.tasks.stop_replica")
def stop_replica(replica_id: str) -> str:
    supervisor = agent.supervisor()
    if replica_id in supervisor.running():
        # Drains first: the request in flight finishes or goes back to its queue (scale-down loses nothing).
        supervisor.stop(replica_id, drain_timeout_s=drain_timeout_of(replica_id))
        return "stopped"
    relay(replica_id, {"event": "stopped"})
    return "not running here"


def _command(replica_id: str, command: dict) -> str:
    try:
        agent.supervisor().send(replica_id, command)
    except (KeyError, ProcessLookupError):
        # The process is gone (the agent restarted, or it died unnoticed): say so rather than wait.
        reason = f"no process for this replica on {agent.node_name()}"
        relay(replica_id, {"event": "failed", "kind": "crash", "reason": reason})
        return "no process"
    return "sent"
