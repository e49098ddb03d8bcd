"""The commands a node agent gets, built from the books: a START carries the whole
ReplicaSpec, a wake the reservation to wake into, a sleep or stop the deployment's drain. Read
from committed rows, so an agent acts on what was decided and never reads the database."""

from __future__ import annotations

from dataclasses import replace

from django.conf import settings
from django.db.models import Max, QuerySet

from gpuportal.wire import memory
from gpuportal.wire.commands import DeepenReplica, ReplicaSpec, SleepReplica, StartReplica, StopReplica, WakeReplica
from scheduling.models import GPU, Replica


def contexts_of(gpus: QuerySet[GPU]) -> tuple[int, int]:
    """(serving context, standby context) in bytes: the largest of `gpus`', in one query."""
    found = gpus.aggregate(c=Max("context_bytes"), s=Max("standby_context_bytes"))
    return largest_contexts(found["c"], found["s"])


def largest_contexts(context: int | None, standby: int | None) -> tuple[int, int]:
    """The largest contexts of some GPUs as `contexts_of` gives them, from their maxima (None:
    no GPU at all, nothing registered yet, and then the H100's figures; a GPU's own 0 stays 0)."""
    return (
        memory.H100_CONTEXT_BYTES if context is None else int(context),
        memory.H100_STANDBY_CONTEXT_BYTES if standby is None else int(standby),
    )


def contexts_for(replica: Replica) -> tuple[int, int]:
    """(serving context, standby context) the replica's reservation counts: its GPUs' own, the
    largest of them, as the scheduler counted them (scheduling.services.placing.need_bytes)."""
    indices = [int(index) for index in replica.gpu_mem_bytes_by_id]
    return contexts_of(GPU.objects.filter(node_id=replica.node_id, index__in=indices))


def _failover_fields(replica: Replica) -> dict:
    if replica.lease_id is None:
        return {}
    return {
        "failover_lease": replica.lease_id,
        "failover_fence": replica.lease.fence,
        "role": replica.role,
        "wake_timeout_s": settings.GPUPORTAL_FAILOVER_WAKE_TIMEOUT_S,
        "liveness_timeout_s": settings.GPUPORTAL_FAILOVER_LIVENESS_TIMEOUT_S,
    }


def spec_of(replica: Replica, *, contexts: tuple[int, int] | None = None, virtual: bool | None = None) -> ReplicaSpec:
    """The replica as its process must run: model, GPUs (node-local indices), cap, contexts. The
    Redis and database URLs are the agent's to add: it knows how it reaches them. `contexts` and
    `virtual`, when the caller knows them (its GPUs' own), spare reading the GPU and node rows."""
    deployment = replica.deployment
    context, standby_context = contexts if contexts is not None else contexts_for(replica)
    return ReplicaSpec(
        replica_id=replica.id,
        source=deployment.model_source,
        loader=deployment.loader,
        dtype=deployment.dtype,
        adapters=deployment.model_adapters,
        prefix_cache=deployment.prefix_cache,
        gpus=tuple(sorted(int(index) for index in replica.gpu_mem_bytes_by_id)),
        reserved_bytes_by_gpu={str(k): int(v) for k, v in replica.gpu_mem_bytes_by_id.items()},
        fraction=replica.gpu_memory_fraction,
        backend="virtual" if (replica.node.virtual if virtual is None else virtual) else "cuda",
        deployment=deployment.name,
        kv_max_tokens=deployment.max_tokens,
        # The reservation counts one CUDA context, and a pair's the standby's too (need_bytes).
        context_bytes=context,
        standby_context_bytes=standby_context if replica.lease_id is not None else 0,
        # A failover member dies with its agent as before: its liveness watchdog lives there.
        adoption_window_s=settings.GPUPORTAL_ADOPTION_WINDOW_S if replica.lease_id is None else 0.0,
        **_failover_fields(replica),
    )


def _committed(replica_id: str) -> Replica | None:
    return Replica.objects.select_related("deployment", "node", "lease").filter(pk=replica_id).first()


def start(replica_id: str, wait_for: list[str]) -> StartReplica | None:
    """None when there is nothing to start any more (the replica went, or is past pending)."""
    replica = _committed(replica_id)
    if replica is None or replica.state != Replica.State.PENDING:
        return None
    return StartReplica(spec=spec_of(replica), wait_for=tuple(wait_for))


def start_placed(replica: Replica, *, contexts: tuple[int, int], virtual: bool, wait_for: list[str]) -> StartReplica:
    """The START of a replica the caller's transaction has just placed (pending, no failover
    lease), from the row as it wrote it and its GPUs' contexts and kind."""
    return StartReplica(spec=spec_of(replica, contexts=contexts, virtual=virtual), wait_for=tuple(wait_for))


def wake(replica_id: str, wait_for: list[str]) -> WakeReplica | StartReplica | None:
    """A waking replica's command: a wake of its sleeping process, or, woken from deep sleep (its
    node holds a host copy of its weights, and no process), the start of one that reads it."""
    replica = _committed(replica_id)
    if replica is None or replica.state != Replica.State.WAKING:
        return None
    if replica.host_copy_bytes > 0:
        return StartReplica(spec=replace(spec_of(replica), from_host_copy=True), wait_for=tuple(wait_for))
    mapping = {str(k): int(v) for k, v in replica.gpu_mem_bytes_by_id.items()}
    return WakeReplica(
        replica_id=replica.id,
        gpus=tuple(sorted(int(k) for k in mapping)),
        reserved_bytes_by_gpu=mapping,
        fraction=replica.gpu_memory_fraction,
        wait_for=tuple(wait_for),
    )


def deepen(replica_id: str) -> DeepenReplica:
    return DeepenReplica(replica_id=replica_id)


def _drain_of(replica_id: str) -> float | None:
    """The deployment's drain_timeout_s (the preemption barrier); None if the row is gone."""
    return Replica.objects.filter(pk=replica_id).values_list("deployment__drain_timeout_s", flat=True).first()


def sleep(replica_id: str) -> SleepReplica:
    return SleepReplica(replica_id=replica_id, drain_timeout_s=_drain_of(replica_id))


def stop(replica_id: str, drain_timeout_s: float | None = None, *, close_pair: bool = False) -> StopReplica:
    """`drain_timeout_s`: the deployment's, when the caller holds its row (no read)."""
    drain = _drain_of(replica_id) if drain_timeout_s is None else drain_timeout_s
    return StopReplica(replica_id=replica_id, drain_timeout_s=drain, close_pair=close_pair)
