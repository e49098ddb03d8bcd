"""The books against the hardware: every heartbeat, the node agent reports what
each replica process really holds per GPU (NVML, or the virtual GPU's model of it) and what other
tenants hold there, and this compares it with the ledger.

A replica (or failover pair: its standby's context is in the active member's reservation) whose
processes hold more than it reserved is an over-commit, shown as `gpuportal_gpu_overcommit_bytes`.
Past the books' tolerance (scheduling.core.books: the larger of GPUPORTAL_BOOKS_TOLERANCE_BYTES and
1 % of the reservation) it is recorded as an Event, its deployment's measured need is raised to
what it really holds so the next replica is reserved enough, and its own reservation grows by the
excess where the GPU has room, so that available_bytes never promises memory NVML does not have.

Other tenants' use (processes that are not the portal's replicas) is recorded on the GPU through
the ledger, which keeps it out of available_bytes; a change past the tolerance is a `gpu.foreign`
Event. Where it reaches into memory the portal's occupants reserve, the excess counts in the
GPU's over-commit figure too, and the Event says so.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction

from gpuportal.wire import memory, states
from gpuportal.wire.node_reports import Books
from scheduling import ledger, locks
from scheduling.core import books as tolerance
from scheduling.models import GPU, Event, Occupant, Replica
from scheduling.services import outbox
from scheduling.services import replicas as replica_services
from scheduling.services.placing import gpu_contexts

log = logging.getLogger(__name__)

# States whose processes hold what their deployment's need describes: serving at max_tokens.
SERVING = (Replica.State.SERVING, Replica.State.DRAINING)


@dataclass(frozen=True)
class Excess:
    """One holder (a replica, or a failover pair's active member) over its reservation on a GPU."""

    replica_id: str
    gpu_id: int
    index: int
    used: int
    reserved: int

    @property
    def bytes(self) -> int:
        return self.used - self.reserved


def over_reservations(
    usage: dict[str, dict[int, int]], reserved: dict[tuple[str, int], int], holder_of: dict[str, str]
) -> list[tuple[str, int, int, int]]:
    """(holder, GPU index, used, reserved) for each holder using more than it reserved on a GPU.

    Pure: `holder_of` maps a replica to the replica whose reservation covers it (a standby to
    its active member; itself otherwise), and a holder's usage is the sum of what it covers."""
    used: dict[tuple[str, int], int] = defaultdict(int)
    for replica_id, figures in usage.items():
        holder = holder_of.get(replica_id, replica_id)
        for index, bytes_ in figures.items():
            used[(holder, index)] += bytes_
    return sorted(
        (holder, index, bytes_, reserved.get((holder, index), 0))
        for (holder, index), bytes_ in used.items()
        if bytes_ > reserved.get((holder, index), 0)
    )


def check(node_name: str, books: Books) -> list[Excess]:
    """Compare the books with what the node's agent saw; act on over-commits. Returns them."""
    gpus = {g.index: g for g in GPU.objects.filter(node__name=node_name).order_by("pk")}
    if not gpus:
        return []
    usage = {
        rid: {int(i): int(b) for i, b in figures.items() if int(i) in gpus} for rid, figures in books.usage.items()
    }
    replicas = {
        r.id: r for r in Replica.objects.filter(pk__in=list(usage)).select_related("deployment", "node", "lease")
    }
    # Deleted meanwhile: not ours. Changed state since it reported: its figure is of another time
    # (an awake figure against a sleeper's books); the next beat has a fresh one.
    usage = {
        rid: figures
        for rid, figures in usage.items()
        if rid in replicas and _same_state(books.states.get(rid), replicas[rid].state)
    }
    holder_of = _holders(replicas.values())
    reserved = {
        (o.replica_id, o.gpu.index): o.reserved_bytes
        for o in Occupant.objects.filter(gpu__in=gpus.values()).select_related("gpu")
    }
    reserved_on: dict[int, int] = defaultdict(int)
    for (_, index), bytes_ in reserved.items():
        reserved_on[index] += bytes_
    # An evicted replica drains with no reservation left: a placement gave it to the replica it
    # made room for, which its node starts only once this one has let go (inference.tasks.
    # wait_released). What it holds meanwhile is leaving, not an over-commit to raise a need for.
    holding = {replica_id for replica_id, _ in reserved}
    leaving = {rid for rid, r in replicas.items() if r.state == Replica.State.DRAINING and rid not in holding}
    found = [
        Excess(holder, gpus[index].pk, index, used, held)
        for holder, index, used, held in over_reservations(usage, reserved, holder_of)
        if holder not in leaving
    ]
    floor = settings.GPUPORTAL_BOOKS_TOLERANCE_BYTES
    _record_foreign(node_name, gpus, books, reserved_on, floor)
    _record_gpu_figures(gpus, usage, books, found, reserved_on)
    for excess in found:
        # Within the tolerance it shows in the gauge only: acting on it would record an Event, and
        # a reservation change, for the wobble of every beat.
        if not tolerance.overcommit_matters(excess.bytes, excess.reserved, floor):
            continue
        _act_on(
            excess, replicas.get(excess.replica_id) or Replica.objects.filter(pk=excess.replica_id).first(), node_name
        )
    return found


def _record_foreign(
    node_name: str, gpus: dict[int, GPU], books: Books, reserved_on: dict[int, int], floor: int
) -> None:
    """Other tenants' use as the agent saw it, into the books where it changed past the
    tolerance: through the ledger (out of available_bytes), with a `gpu.foreign` Event saying
    what it leaves, and whether it reaches into reserved memory. `gpus` are updated to match."""
    if books.foreign_by_index is None:
        return
    for index, gpu in sorted(gpus.items(), key=lambda item: item[1].pk):
        seen = books.foreign_by_index.get(str(index))
        if seen is None:
            continue
        wanted = tolerance.foreign_to_record(gpu.foreign_bytes, int(seen), floor)
        if wanted is None:
            continue
        label = f"{node_name}/{index}"
        with transaction.atomic():
            change = ledger.record_foreign(gpu.pk, wanted)
            if change is None:
                continue
            into = tolerance.intrusion(change.total_bytes, change.after, change.reserved_bytes)
            what = (
                f"processes that are not the portal's replicas hold {memory.human_bytes(change.after)} on {label} "
                f"(was {memory.human_bytes(change.before)}): {memory.human_bytes(change.available_after)} "
                f"left to place (was {memory.human_bytes(change.available_before)})"
            )
            spare = int((books.spare_by_index or {}).get(str(index), 0))
            if spare:
                what += f"; {memory.human_bytes(min(spare, change.after))} of it is the node's warm spare"
            if into:
                what += (
                    f"; {memory.human_bytes(into)} of it is memory reserved for the portal's replicas, which "
                    "is over-committed until they or the other tenants let go of it"
                )
            outbox.note(
                Event.Kind.GPU_FOREIGN,
                f"gpu {label}",
                what,
                before={"foreign_bytes": change.before, "available_bytes": change.available_before},
                after={
                    "foreign_bytes": change.after,
                    "available_bytes": change.available_after,
                    "reserved_bytes": change.reserved_bytes,
                    "intrusion_bytes": into,
                },
                node=node_name,
                gpu=label,
            )
        if into:
            log.warning("other tenants: %s", what)
        gpu.foreign_bytes, gpu.available_bytes = change.after, change.available_after


# What the control plane calls the state a replica reports itself in.
_REPORTED_AS = {
    Replica.State.SERVING: states.HOLDING_WEIGHTS,
    Replica.State.SLEEPING: (Replica.State.SLEEPING,),
    Replica.State.STANDBY: (Replica.State.STANDBY,),
}


def _same_state(reported: str | None, state: str) -> bool:
    """Whether a figure reported in `reported` may be held against a replica now in `state`; a
    figure whose state is not known (an older agent) is taken as current."""
    if not reported:
        return True
    return state in _REPORTED_AS.get(reported, (reported,))


def _holders(replicas) -> dict[str, str]:
    """A pair's members are covered by whichever member holds the pair's occupant (the active)."""
    lease_ids = {r.lease_id for r in replicas if r.lease_id is not None}
    holding = dict(
        Occupant.objects.filter(replica__lease_id__in=lease_ids).values_list("replica__lease_id", "replica_id")
    )
    return {r.id: holding.get(r.lease_id, r.id) if r.lease_id is not None else r.id for r in replicas}


def _record_gpu_figures(
    gpus: dict[int, GPU],
    usage: dict[str, dict[int, int]],
    books: Books,
    found: list[Excess],
    reserved_on: dict[int, int],
):
    over: dict[int, int] = defaultdict(int)
    for excess in found:
        over[excess.index] += excess.bytes
    held: dict[int, int] = defaultdict(int)
    for figures in usage.values():
        for index, bytes_ in figures.items():
            held[index] += bytes_
    for index, gpu in sorted(gpus.items(), key=lambda item: item[1].pk):
        # Other tenants in reserved memory: bytes the books promised that NVML no longer has.
        over[index] += tolerance.intrusion(gpu.total_bytes, gpu.foreign_bytes, reserved_on[index])
        if books.free_by_index is not None and str(index) in books.free_by_index:
            free = int(books.free_by_index[str(index)])
        else:
            # A virtual GPU: what CUDA could allocate less what its processes and other tenants hold.
            free = max(0, gpu.total_bytes - held[index] - gpu.foreign_bytes)
        spare = gpu.spare_bytes
        if books.spare_by_index is not None:
            spare = min(int(books.spare_by_index.get(str(index), 0)), gpu.foreign_bytes)
        if gpu.overcommit_bytes != over[index] or gpu.nvml_free_bytes != free or gpu.spare_bytes != spare:
            # One row per statement, outside any transaction: this never holds two GPU rows at
            # once, so it cannot deadlock with a ledger commit locking them in primary-key order.
            GPU.objects.filter(pk=gpu.pk).update(overcommit_bytes=over[index], nvml_free_bytes=free, spare_bytes=spare)


def _act_on(excess: Excess, replica: Replica | None, node_name: str) -> None:
    if replica is None:
        return
    deployment = replica.deployment
    what = (
        f"replica {replica.id[:8]} ({deployment.name}) holds {memory.human_bytes(excess.used)} on "
        f"{node_name}/{excess.index}, {memory.human_bytes(excess.bytes)} more than its reservation of "
        f"{memory.human_bytes(excess.reserved)}"
    )
    raised = _raise_need(replica, excess) if replica.state in SERVING else None
    grown = excess.reserved
    then = []
    # Serving or asleep, its reservation is settled and may grow; one on its way (loading,
    # waking, a standby taking over) is left to the report that ends the move.
    if replica.state in SERVING or replica.state == Replica.State.SLEEPING:
        grown = min(excess.used, excess.reserved + max(0, GPU.objects.get(pk=excess.gpu_id).available_bytes))
        reservation = {int(k): int(v) for k, v in (replica.gpu_mem_bytes_by_id or {}).items()}
        reservation[excess.index] = grown
        replica_services.reserve_exactly(replica, reservation, reason=f"the books against NVML: {what}")
        Replica.objects.filter(pk=replica.pk).update(gpu_mem_bytes_by_id={str(k): v for k, v in reservation.items()})
        then.append(f"its reservation grows to {memory.human_bytes(grown)}")
        if grown < excess.used:
            then.append(f"the GPU has no room for the other {memory.human_bytes(excess.used - grown)}")
    else:
        then.append(f"it is {replica.state}: its reservation is left to its next report")
    if raised is not None:
        then.append(f"{deployment.name}'s measured need is raised to {memory.human_bytes(raised)}")
    outbox.note(
        Event.Kind.GPU_OVERCOMMIT,
        f"gpu {node_name}/{excess.index}",
        f"{what}: {'; '.join(then)}",
        before={"reserved_bytes": excess.reserved},
        after={"used_bytes": excess.used, "reserved_bytes": grown, "measured_bytes": raised},
        node=node_name,
        gpu=f"{node_name}/{excess.index}",
        deployment=deployment.name,
        replica=replica.id,
    )
    log.warning("over-commit: %s", what)


def _raise_need(replica: Replica, excess: Excess) -> int | None:
    """A serving replica's processes really hold `used` on this GPU: its deployment's need is at
    least that (less the standby's context in a pair, which need_bytes adds on its own)."""
    used = excess.used
    if replica.lease_id is not None:
        used -= gpu_contexts([excess.gpu_id])[1]
    with transaction.atomic():
        deployment = locks.lock_deployment_of(replica)
        before = deployment.observed.memory_measured_bytes
        if before is not None and before >= used:
            return None
        replica_services.set_measured_need(
            deployment,
            used,
            replica,
            f"measured need raised to {memory.human_bytes(used)}: a replica's process held that much "
            f"(was {memory.human_bytes(before or 0)})",
            # NVML's figure holds the process's context as it is now, at most the GPU's figure.
            context=gpu_contexts([excess.gpu_id])[0],
        )
    return used
