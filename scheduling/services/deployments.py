"""Deploy, change, scale, evict and delete deployments: snapshot → plan → commit → dispatch.

Lock order, the same everywhere (so two services never wait on each other in a cycle):
the deployment row, then GPU rows in primary-key order (the ledger), then replica rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from gpuportal.wire import memory
from scheduling import events, fairness, hot_sql, ledger, locks
from scheduling.models import GPU, Deployment, Event, Replica, new_replica_id
from scheduling.placement import POLICIES, CachedReplica, CantAccommodate, Placement, PlacementRequest, Policy
from scheduling.planning import place_all, withhold_locked
from scheduling.services import dispatch, failover, queueing, replica_specs
from scheduling.services import replicas as replica_services
from scheduling.services.errors import AlreadyExists, CannotPlace, InvalidInput, NotFound
from scheduling.services.replica_specs import contexts_of
from scheduling.state import GPUView, OccupantView, Plan, Release, Snapshot

# Replicas that are, or are about to be, on their GPUs: what `replicas` counts.
AWAKE = (Replica.State.PENDING, Replica.State.LOADING, Replica.State.SERVING, Replica.State.WAKING)
# Replicas whose process is gone or going; they hold no reservation.
GONE = (Replica.State.STOPPING, Replica.State.STOPPED, Replica.State.FAILED)


@dataclass(frozen=True)
class DeploymentSpec:
    """A validated deployment as a user asked for it (the REST shape of DESIGN §7, flattened)."""

    name: str
    source: str
    loader: str = Deployment.Loader.TRANSFORMERS
    dtype: str = Deployment.DType.FLOAT32
    replicas: int = 1
    dedicated: bool = False
    override_bytes: int | None = None
    max_tokens: int = 2048
    min_runtime_s: float = 10.0
    max_wait_s: float = 5.0
    popular: bool = False
    idle_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    standby: bool = False
    memory_policy: str = "gpuportal"
    max_load_failures: int = 3
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    spread: bool = False


# Deployment fields a PATCH may change, by spec name. Model, loader and dtype are not among them:
# a different model is a different deployment.
MUTABLE = {
    "dedicated": "dedicated",
    "override_bytes": "memory_override_bytes",
    "max_tokens": "max_tokens",
    "min_runtime_s": "min_runtime_s",
    "max_wait_s": "max_wait_s",
    "popular": "popular",
    "idle_timeout_s": "idle_timeout_s",
    "drain_timeout_s": "drain_timeout_s",
    "max_load_failures": "max_load_failures",
    "backoff_s": "load_backoff_s",
    "backoff_max_s": "load_backoff_max_s",
    "spread": "placement_spread",
}


@dataclass(frozen=True)
class ModelFacts:
    weight_bytes: int
    estimate_bytes: int
    detail: str = ""


@dataclass
class _Decision:
    """What the last planning attempt decided, for the effects after the commit."""

    placements: tuple[Placement, ...] = ()
    new_ids: list[str] = field(default_factory=list)
    # The rows this call creates for them, written by the commit's apply: no other transaction
    # sees them before it commits, so nothing need read them back.
    created: dict[str, Replica] = field(default_factory=dict)
    # The GPUs the plan was made on: the commit's compare-and-swap found the ones it writes
    # unchanged, so their node, index and contexts are the books' own.
    gpus: dict[int, GPUView] = field(default_factory=dict)


def inspect_model(source: str, loader: str, dtype: str, max_tokens: int) -> ModelFacts:
    """Weight bytes and the estimated need, without loading weights: a node agent reads the
    files (never this process, issue 17), the estimate is the control plane's. Bad sources
    name the field."""
    reading = dispatch.inspect(source, loader, dtype)
    if reading.refusal:
        raise InvalidInput("model.source", reading.refusal)
    if reading.shape is not None:
        estimate = memory.estimate(reading.shape, max_tokens=max_tokens, cuda_context_bytes=0)
        return ModelFacts(reading.shape.weight_bytes, estimate.total_bytes, estimate.describe())
    weights = reading.weight_bytes
    return ModelFacts(weights, weights + memory.ACTIVATION_FLOOR_BYTES, "weights + activation floor")


def get(name: str, *, lock: bool = False) -> Deployment:
    if lock:
        return locks.lock_deployment(name)
    try:
        return Deployment.objects.get(name=name)
    except Deployment.DoesNotExist:
        raise NotFound(f"no deployment named {name!r}") from None


@locks.retry_deadlocks
def create(spec: DeploymentSpec, *, facts: ModelFacts | None = None) -> Deployment:
    """Create the deployment and place all its replicas, or nothing at all (409 with reasons)."""
    if memory.POLICIES.get(spec.memory_policy) is None:
        raise InvalidInput("memory.policy", f"unknown policy {spec.memory_policy!r} (gpuportal or ndif)")
    if spec.loader == Deployment.Loader.TORCH_MODULE and not torch_module_allowed(spec.source):
        listed = ", ".join(settings.GPUPORTAL_TORCH_MODULES) or "none"
        raise InvalidInput(
            "model.source",
            f"{spec.source!r} is code the nodes would run: only modules an operator lists in "
            f"GPUPORTAL_TORCH_MODULES may be deployed (listed: {listed})",
        )
    taken = AlreadyExists("name", f"a deployment named {spec.name!r} already exists")
    if Deployment.objects.filter(name=spec.name).exists():
        raise taken  # before asking a node to read the model
    facts = facts or inspect_model(spec.source, spec.loader, spec.dtype, spec.max_tokens)
    # Its Events are written in one statement at the end (the savepoint's error below ends the call).
    with transaction.atomic(), events.gathered():
        try:
            # A savepoint: a create of the same name that committed since the check above makes
            # this insert fail on the unique name, which is a 409 like the check's, not a 500.
            with transaction.atomic():
                deployment = _insert(spec, facts)
        except IntegrityError:
            raise taken from None
        events.record(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {spec.name}",
            f"created with {spec.replicas} replica(s) of {spec.source} ({spec.loader}, {spec.dtype}); "
            f"estimated need {memory.human_bytes(facts.estimate_bytes)}: {facts.detail}".rstrip(": "),
            after={"replicas": spec.replicas, "estimate_bytes": facts.estimate_bytes},
            deployment=spec.name,
        )
        if spec.replicas:
            # A deployment this transaction made has no replica yet: no sleeping one to promote,
            # no parked one to retire (two queries fewer).
            add_replicas(deployment, spec.replicas, reason=f"deploy {spec.name}", cached=(), parked=False)
    return deployment


def torch_module_allowed(source: str) -> bool:
    """Whether `source` (package.module:factory) is in a module an operator allowed."""
    module = source.partition(":")[0]
    return any(module == allowed or module.startswith(f"{allowed}.") for allowed in settings.GPUPORTAL_TORCH_MODULES)


def _insert(spec: DeploymentSpec, facts: ModelFacts) -> Deployment:
    return Deployment.objects.create(
        name=spec.name,
        model_source=spec.source,
        loader=spec.loader,
        dtype=spec.dtype,
        replicas_wanted=spec.replicas,
        dedicated=spec.dedicated,
        memory_override_bytes=spec.override_bytes,
        memory_estimate_bytes=facts.estimate_bytes,
        weight_bytes=facts.weight_bytes,
        memory_policy=spec.memory_policy,
        max_tokens=spec.max_tokens,
        min_runtime_s=spec.min_runtime_s,
        max_wait_s=spec.max_wait_s,
        popular=spec.popular,
        idle_timeout_s=spec.idle_timeout_s,
        drain_timeout_s=spec.drain_timeout_s,
        failover_standby=spec.standby,
        max_load_failures=spec.max_load_failures,
        load_backoff_s=spec.backoff_s,
        load_backoff_max_s=spec.backoff_max_s,
        placement_spread=spec.spread,
    )


@locks.retry_deadlocks
def update(name: str, changes: dict[str, Any]) -> Deployment:
    """Change settings (and the replica count, through scale). Unknown fields are a caller bug."""
    unknown = set(changes) - set(MUTABLE) - {"replicas", "standby"}
    if unknown:
        raise InvalidInput(sorted(unknown)[0], "cannot be changed on an existing deployment")
    changes = dict(changes)
    with transaction.atomic():
        deployment = get(name, lock=True)
        if "standby" in changes and changes.pop("standby") != deployment.failover_standby:
            # Its replicas run without a pair's lock (or hold one): pairing them up, or splitting
            # them, would need every process restarted; a new deployment says so honestly.
            raise InvalidInput(
                "failover.standby", "cannot be changed on an existing deployment; create a new deployment instead"
            )
        before = {key: getattr(deployment, MUTABLE[key]) for key in changes if key in MUTABLE}
        after = {key: value for key, value in changes.items() if key in MUTABLE and before[key] != value}
        for key, value in after.items():
            setattr(deployment, MUTABLE[key], value)
        if after:
            deployment.save()
            events.record(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {name}",
                "settings changed: " + ", ".join(f"{k} {before[k]!r} → {v!r}" for k, v in after.items()),
                before={k: before[k] for k in after},
                after=after,
                deployment=name,
            )
            if deployment.failed_reason:
                # A changed spec is the operator's answer to the failure: try again.
                retry(name, reason="its settings changed")
        if "replicas" in changes:
            scale(name, changes["replicas"])
    deployment.refresh_from_db()
    return deployment


@dataclass(frozen=True)
class _Census:
    """A deployment's replicas, read in one query for a scale call: what it counts awake, what it
    may promote, whether any is parked, and each replica's state and node for a stop."""

    awake: list[str]  # newest first, failover standbys left out (they go with their active member)
    cached: tuple[CachedReplica, ...]
    parked: bool
    rows: dict[str, tuple[str, str | None]]  # replica id → (state, node name)

    @classmethod
    def locking(cls, name: str) -> tuple[Deployment, _Census]:
        """The deployment's row locked, and its census."""
        deployment, (rows,) = locks.lock_deployment_reading(name, (_CENSUS_SQL, [name]))
        awake, cached, parked, by_id = [], [], False, {}
        for replica_id, state, role, node in rows:
            by_id[replica_id] = (state, node)
            if state in AWAKE and role != Replica.Role.STANDBY:
                awake.append(replica_id)
            elif state == Replica.State.SLEEPING and node is not None:
                cached.append(CachedReplica(replica_id, node))
            parked = parked or state == Replica.State.PARKED
        return deployment, cls(awake=awake, cached=tuple(cached), parked=parked, rows=by_id)


# Not the gone ones: nothing here counts or stops them, and their rows pile up until swept.
_CENSUS_SQL = (
    "SELECT r.id, r.state, r.role, n.name FROM scheduling_replica r "
    "LEFT JOIN scheduling_node n ON n.id = r.node_id "
    "WHERE r.deployment_id = (SELECT id FROM scheduling_deployment WHERE name = %s) "
    f"AND r.state NOT IN ({', '.join(repr(str(state)) for state in GONE)}) "
    "ORDER BY r.created_at DESC"
)


@locks.retry_deadlocks
def scale(name: str, replicas: int, *, reason: str = "scaled by an operator") -> Deployment:
    """Bring the number of awake replicas to `replicas`: cached ones are promoted before new ones
    are created; scaling down stops the most recently started first (they have served least)."""
    if replicas < 0:
        raise InvalidInput("replicas", "must be 0 or more")
    # Its Events are written in one statement at the end (nothing inside catches and goes on).
    with transaction.atomic(), events.gathered():
        # The deployment row lock serialises scale operations of one deployment, so the census
        # read with it stays true until the commit.
        deployment, census = _Census.locking(name)
        awake = census.awake
        before = deployment.replicas_wanted
        if replicas > len(awake):
            add_replicas(
                deployment,
                replicas - len(awake),
                reason=f"{reason}: {len(awake)} → {replicas}",
                cached=census.cached,
                parked=census.parked,
            )
        elif replicas < len(awake):
            stopping = awake[: len(awake) - replicas]
            _stop_replicas(
                deployment,
                stopping,
                reason=f"{reason}: {len(awake)} → {replicas}",
                known={replica_id: census.rows[replica_id] for replica_id in stopping},
            )
        deployment.replicas_wanted = replicas
        hot_sql.update(deployment, ["replicas_wanted"])
        if census.parked:
            # Parked replicas beyond the new count are wanted no more.
            surplus = deployment.replicas.filter(PLAIN_COUNTED).count() - replicas
            _retire_parked(deployment, surplus, reason=f"{reason}: no longer wanted")
        if before != replicas:
            events.record(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {name}",
                f"{reason}: {before} → {replicas} replica(s)",
                before={"replicas": before},
                after={"replicas": replicas},
                deployment=name,
            )
    return deployment


# -- crash-loop backoff (issue 16) ----------------------------------------------------------------

REPLACE_TASK = "scheduling.tasks.replace_failed"
# Replicas that count toward a deployment's replicas while a failed load is replaced: serving,
# sleeping, or on their way to either. A failover standby is its active member's, not one more.
# A parked replica (issue 19: it left a full host cache) is still wanted: the next wake loads it.
COUNTED = (*AWAKE, Replica.State.DRAINING, Replica.State.SLEEPING, Replica.State.PARKED)
# A failover pair counts once while any member lives: between its active member's death and its
# standby's takeover report, the standby is the pair (a reconcile in that window must not place
# a second pair).
PLAIN_COUNTED = Q(lease__isnull=True, state__in=COUNTED)
PAIR_LIVE = Q(lease__isnull=False, state__in=(*COUNTED, Replica.State.STANDBY))


def counted(deployment: Deployment) -> int:
    """How many of what the deployment wants it has: plain replicas serving, sleeping or on their
    way, and failover pairs with a member alive."""
    plain = deployment.replicas.filter(PLAIN_COUNTED).count()
    pairs = deployment.replicas.filter(PAIR_LIVE).values("lease").distinct().count()
    return plain + pairs


def backoff_s(deployment: Deployment, failures: int) -> float:
    """Seconds before the replacement of the `failures`-th failed load in a row: doubling from
    load_backoff_s, capped at load_backoff_max_s."""
    return min(deployment.load_backoff_max_s, deployment.load_backoff_s * 2 ** max(0, failures - 1))


def note_load_failure(deployment: Deployment, replica_id: str, reason: str) -> bool:
    """A replica of the deployment (its row locked by the caller) failed to load. Either a
    replacement is scheduled after the backoff, or, at max_load_failures in a row, the deployment
    is failed with the error and starts nothing more. Returns True if a retry is pending."""
    deployment.load_failures += 1
    failures, limit = deployment.load_failures, deployment.max_load_failures
    if failures >= limit:
        deployment.failed_reason = reason
        deployment.retry_at = None
        deployment.save(update_fields=["load_failures", "failed_reason", "retry_at", "updated_at"])
        events.record(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {deployment.name}",
            f"failed: {failures} load(s) in a row failed, the last (replica {replica_id[:8]}): {reason}; "
            f"nothing more starts until it is retried (POST /api/deployments/{deployment.name}/retry/) "
            "or its settings change",
            after={"status": "failed", "load_failures": failures},
            deployment=deployment.name,
            replica=replica_id,
        )
        return False
    delay = backoff_s(deployment, failures)
    deployment.retry_at = timezone.now() + timedelta(seconds=delay)
    deployment.save(update_fields=["load_failures", "retry_at", "updated_at"])
    events.record(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        f"load {failures} of at most {limit} in a row failed (replica {replica_id[:8]}): {reason}; "
        f"a replacement starts in {delay:g} s",
        after={"load_failures": failures, "retry_in_s": delay},
        deployment=deployment.name,
        replica=replica_id,
    )
    dispatch.to_control(REPLACE_TASK, deployment.name, countdown=delay)
    return True


def note_loaded(deployment: Deployment) -> None:
    """A replica loaded: the failures in a row are over (the caller holds the row)."""
    if deployment.load_failures or deployment.retry_at or deployment.failed_reason:
        deployment.load_failures, deployment.retry_at, deployment.failed_reason = 0, None, ""
        deployment.save(update_fields=["load_failures", "retry_at", "failed_reason", "updated_at"])


def replace_failed(name: str) -> list[str]:
    """The backoff of a failed load is over: place what the deployment lacks (its replicas, or
    one for the requests that wait when it wants none awake). Returns the replicas placed."""
    with transaction.atomic():
        deployment = locks.lock_deployment_if_there(name=name)
        if deployment is None or deployment.failed_reason or deployment.retry_at is None:
            return []  # deleted, given up, or retried by hand meanwhile
        deployment.retry_at = None
        deployment.save(update_fields=["retry_at", "updated_at"])
        wanted = deployment.replicas_wanted or (1 if _requests_wait(name) else 0)
        return _top_up(
            deployment,
            wanted,
            f"replacing a failed load ({deployment.load_failures} in a row) after its backoff",
        )


def reconcile(name: str, reason: str) -> list[str]:
    """Keep what the operator asked for (issue 16): place what the deployment lacks of its
    `replicas`, sleeping ones counted, never stopping any. Not while a failed load waits out its
    backoff, nor once it gave up. Returns the replicas placed."""
    with transaction.atomic(durable=True):  # a boundary: its callers hold no transaction
        deployment = locks.lock_deployment_if_there(name=name)
        if deployment is None or deployment.failed_reason or deployment.retry_at is not None:
            return []
        return _top_up(deployment, deployment.replicas_wanted, reason)


def reconcile_all(reason: str) -> dict[str, list[str]]:
    """`reconcile` every deployment that has fewer replicas than it wants: one query to find them."""
    short = (
        Deployment.objects.filter(failed_reason="", retry_at__isnull=True, replicas_wanted__gt=0)
        .annotate(
            plain=Count("replicas", filter=Q(replicas__lease__isnull=True, replicas__state__in=COUNTED)),
            pairs=Count(
                "replicas__lease",
                filter=Q(replicas__lease__isnull=False, replicas__state__in=(*COUNTED, Replica.State.STANDBY)),
                distinct=True,
            ),
        )
        .filter(replicas_wanted__gt=F("plain") + F("pairs"))
        .order_by("name")
        .values_list("name", flat=True)
    )
    placed = {name: reconcile(name, reason) for name in short}
    return {name: ids for name, ids in placed.items() if ids}


def _top_up(deployment: Deployment, wanted: int, reason: str) -> list[str]:
    """Place new replicas up to `wanted` (the caller holds the deployment row). What cannot be
    placed now is said in an Event; the next reconcile or request tries again."""
    have = counted(deployment)
    if have >= wanted:
        return []
    try:
        with transaction.atomic():  # a savepoint: nothing of a placement that cannot be made
            decision = add_replicas(
                deployment,
                wanted - have,
                reason=f"{reason}: {have} of {wanted} replica(s)",
                cached=(),  # the sleeping ones are counted already
            )
    except CannotPlace as err:
        events.record(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {deployment.name}",
            f"{reason}: {have} of {wanted} replica(s), and no room for more: {err}",
            deployment=deployment.name,
        )
        return []
    return list(Replica.objects.filter(pk__in=decision.new_ids).values_list("pk", flat=True))


def _requests_wait(name: str) -> bool:
    """Whether requests wait for the deployment (for one that wants no replica awake by itself);
    when Redis cannot say, as if they did: a replica too many idles until it sleeps, while one too
    few leaves requests waiting for nothing."""

    try:
        return queueing.queue_depth(name) > 0
    except redis.RedisError:
        return True


@locks.retry_deadlocks
def retry(name: str, *, reason: str = "retried by an operator") -> Deployment:
    """Clear a failed deployment (or the backoff of one retrying) and place what it lacks now."""
    with transaction.atomic():
        deployment = get(name, lock=True)
        was = deployment.failed_reason
        deployment.load_failures, deployment.failed_reason = 0, ""
        deployment.retry_at = timezone.now()  # due now: replace_failed below places at once
        deployment.save(update_fields=["load_failures", "failed_reason", "retry_at", "updated_at"])
        events.record(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {name}",
            f"{reason}: load failures cleared" + (f" (it had failed: {was})" if was else ""),
            before={"status": "failed" if was else "ok"},
            after={"status": "ok"},
            deployment=name,
        )
        replace_failed(name)
    deployment.refresh_from_db()
    return deployment


@locks.retry_deadlocks
def evict(name: str, *, reason: str = "evicted by an operator") -> list[str]:
    """Put every serving replica of the deployment to sleep (weights to CPU RAM)."""
    with transaction.atomic():
        deployment = get(name, lock=True)
        serving = list(deployment.replicas.filter(state=Replica.State.SERVING).values_list("id", flat=True))
        for replica_id in serving:
            replica_services.evict(replica_id, reason=reason, deployment=deployment)
    return serving


@locks.retry_deadlocks
def delete(name: str, *, reason: str = "deleted by an operator") -> None:
    """Release every reservation, stop every process, and forget the deployment."""
    with transaction.atomic(), events.gathered():
        deployment = get(name, lock=True)
        replicas = list(deployment.replicas.select_related("node"))
        ledger.commit_with_retry(releasing({r.id for r in replicas}, f"{reason}: deployment {name}"))
        for replica in replicas:
            if replica.node is not None and replica.state not in (Replica.State.STOPPED, Replica.State.FAILED):
                # The drain as the row says it now: after the commit there is no row to read it from.
                dispatch.stop(replica.node.name, replica.id, drain_timeout_s=deployment.drain_timeout_s)
        events.record(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {name}",
            f"{reason}: {len(replicas)} replica(s) stopped and their reservations released",
            before={"replicas": len(replicas)},
            deployment=name,
        )
        deployment.delete()
        # Nothing will ever serve what still waits in its queue: end it now, saying why (once the
        # delete has committed). Requests already taken finish first: stopping waits for them.
        # Imported here: the request service itself builds on this module.

        transaction.on_commit(lambda: queueing.fail_waiting(name, f"deployment {name} was deleted", deleted=True))


# -- placing and stopping replicas -------------------------------------------------------------


def releasing(replica_ids: set[str], reason: str) -> Callable[[Snapshot], Plan | None]:
    """A decision releasing every reservation the replicas hold, or None when they hold none."""

    def decide(snap: Snapshot) -> Plan | None:
        holdings = snap.index.holdings  # where each replica holds memory, without a walk of every GPU
        releases = sorted(
            (Release(gpu.id, replica_id) for replica_id in replica_ids for gpu, _ in holdings.get(replica_id, ())),
            key=lambda r: (r.gpu_id, r.replica_id),
        )
        return Plan.against(snap, reason, releases=releases) if releases else None

    return decide


def need_bytes(deployment: Deployment, snapshot: Snapshot) -> memory.Need:
    """The bytes one replica of the deployment reserves: its need under the deployment's policy
    (gpuportal.wire.memory's footprint) with a CUDA context, plus, in a failover pair, the context its
    sleeping standby keeps beside it. Contexts are the GPUs' own (measured per node and model, or
    the virtual GPU's), the largest among the snapshot's GPUs, so the need fits wherever it goes."""
    need = memory.need_for(
        deployment.memory_policy,
        memory.NeedInputs(
            weight_bytes=deployment.weight_bytes,
            estimate_bytes=deployment.memory_estimate_bytes,
            override_bytes=deployment.memory_override_bytes,
            measured_bytes=deployment.memory_measured_bytes,
        ),
    )
    context, standby_context = snapshot.index.contexts
    # A measured need is the replica's own footprint, its context included (as it was measured:
    # the GPUs' context may have grown since); others have none.
    if need.source == "measured":
        grown = memory.with_grown_context(need.bytes, deployment.memory_measured_context_bytes, context)
        need = replace(need, bytes=grown)
    else:
        need = replace(need, bytes=need.bytes + context)
    if deployment.failover_standby:
        need = replace(need, bytes=need.bytes + standby_context)
    return need


def gpu_contexts(gpu_ids: Iterable[int]) -> tuple[int, int]:
    """(serving context, standby context) in bytes: the largest of these GPUs' (issue 15)."""
    return contexts_of(GPU.objects.filter(pk__in=list(gpu_ids)))


def cached_of(deployment: Deployment) -> tuple[CachedReplica, ...]:
    """The deployment's sleeping replicas, each on the node whose RAM holds its weights: the
    replicas placement promotes before it creates new ones."""
    return tuple(
        CachedReplica(replica_id, node)
        for replica_id, node in deployment.replicas.filter(
            state=Replica.State.SLEEPING, node__isnull=False
        ).values_list("id", "node__name")
    )


def add_replicas(
    deployment: Deployment,
    count: int,
    *,
    reason: str,
    cached: tuple[CachedReplica, ...] | None = None,
    allow_new: bool = True,
    evictions: bool = True,
    new_ids: list[str] | None = None,
    parked: bool = True,
) -> _Decision:
    """Place `count` more replicas as one all-or-nothing decision, promoting sleeping ones first.

    `cached` narrows the sleeping replicas that may be promoted (default: all of the
    deployment's); `allow_new=False` only promotes, which is how one named replica is woken.
    `evictions=False` uses only free memory (the fair wake path: victims are fairness.py's
    call, not placement's). `new_ids` are rows the caller already created (a waker that held a
    wake lock under that id); they are kept even if unused. `parked=False`: the caller knows the
    deployment has no parked replica (none to retire for a new load). The caller holds the
    deployment row lock.
    """
    if cached is None:
        cached = cached_of(deployment)
    # Placement needs an id per request even when it may only promote; those ids never get rows.
    decision = _Decision(new_ids=list(new_ids) if new_ids is not None else [new_replica_id() for _ in range(count)])
    policy: str | Policy = deployment.memory_policy
    if not evictions:
        policy = replace(POLICIES[deployment.memory_policy], evictions=False)

    mine = [*decision.new_ids, *(c.replica_id for c in cached)]

    def decide(snap: Snapshot) -> Plan:
        need = need_bytes(deployment, snap)
        snap, withheld = withhold_locked(snap, mine, timezone.now())
        requests = placement_requests(deployment, decision.new_ids, need.bytes, cached, allow_new=allow_new)
        result = place_all(
            snap,
            requests,
            occupant_for=lambda placement: _occupant_for(deployment, placement),
            reason=f"{reason} ({need})",
            policy=policy,
        )
        if isinstance(result, CantAccommodate):
            if withheld:
                locked = ", ".join(withheld)
                reasons = {**result.reasons, **{label: "another wake holds its wake lock" for label in withheld}}
                raise CannotPlace(f"{result.reason} (not counting {locked}: another wake holds its lock)", reasons)
            raise CannotPlace(result.reason, result.reasons)
        decision.placements = result.placements
        decision.gpus = snap.gpus
        return result.plan

    if allow_new and new_ids is None:
        # Rows written by the commit's apply, placed, and only for the ids placement used (a
        # promotion can make one unneeded). The occupants the ledger writes first point at them
        # before they exist: the foreign key is checked at commit.
        decision.created = {i: Replica(id=i, deployment=deployment) for i in decision.new_ids}
    ledger.commit_with_retry(decide, apply=lambda plan: _apply_placements(deployment, decision, reason))
    loaded = sum(1 for p in decision.placements if p.promoted is None)
    if parked:
        _retire_parked(deployment, loaded, reason=f"replaced by a load from disk ({reason})")
    return decision


def placement_requests(
    deployment: Deployment,
    replica_ids: list[str],
    need: int,
    cached: tuple[CachedReplica, ...],
    *,
    allow_new: bool = True,
) -> list[PlacementRequest]:
    """What placement is asked for each replica of the deployment: its need, its settings and the
    sleeping copies it may promote instead."""
    return [
        PlacementRequest(
            deployment=deployment.name,
            replica_id=replica_id,
            need_bytes=need,
            dedicated=deployment.dedicated,
            cached=cached,
            allow_new=allow_new,
            spread=deployment.placement_spread,
        )
        for replica_id in replica_ids
    ]


def _occupant_for(deployment: Deployment, placement: Placement) -> OccupantView:
    """A placed replica as the snapshot shows it until its process reports."""
    return OccupantView(
        replica_id=placement.replica_id,
        deployment=deployment.name,
        state=Replica.State.PENDING,
        reserved_bytes=0,
        dedicated=deployment.dedicated,
        popular=deployment.popular,
        min_runtime_s=deployment.min_runtime_s,
    )


def _retire_parked(deployment: Deployment, count: int, *, reason: str) -> None:
    """Parked replicas (issue 19) that new loads replace, or a lower count no longer wants:
    stopped, oldest first. The caller holds the deployment row."""
    if count <= 0:
        return
    for replica in deployment.replicas.filter(state=Replica.State.PARKED).order_by("created_at")[:count]:
        replica_services.set_state(replica, Replica.State.STOPPED, reason)


def _apply_placements(deployment: Deployment, decision: _Decision, reason: str) -> None:
    """Inside the commit: record where each replica went (and, after the placement's own reason,
    the caller's: deploy, scale, wake), then send the agents to work."""
    gpus = decision.gpus
    victims = {e.replica_id for p in decision.placements for e in p.evictions}
    # Most placements evict nobody: no query then (Django compiles even one it knows is empty).
    for victim in _replicas_in_pk_order(victims) if victims else ():
        _mark_evicted(victim, next(p for p in decision.placements if victim.id in p.evicted_replicas))
    placed = []
    for placement in decision.placements:
        first = gpus[placement.gpu_ids[0]]
        by_index = {str(gpus[g].index): placement.bytes_by_gpu[g] for g in placement.gpu_ids}
        promoted = placement.promoted is not None
        replica = decision.created.get(placement.replica_id) or Replica.objects.get(pk=placement.replica_id)
        before = {"state": replica.state, "node": replica.node_id and first.node, "gpus": replica.gpu_mem_bytes_by_id}
        replica.node_id = first.node_id
        replica.gpu_mem_bytes_by_id = by_index
        replica.gpu_memory_fraction = placement.fraction
        replica.state = Replica.State.WAKING if promoted else Replica.State.PENDING
        replica.progress = 0
        replica.failure_reason = ""
        placed.append((placement, replica, before, first, promoted))
    # New rows in one statement; rows that were there (a promotion, a caller's own) saved each.
    hot_sql.insert([p[1] for p in placed if p[1].id in decision.created])
    for placement, replica, before, first, promoted in placed:
        if replica.id not in decision.created:
            replica.save()
        events.record(
            Event.Kind.REPLICA_STATE,
            f"replica {replica.id[:8]}",
            ("promoted from the CPU cache: " if promoted else "placed: ") + f"{placement.reason}; {reason}",
            before=before,
            after={
                "state": replica.state,
                "node": first.node,
                "gpus": replica.gpu_mem_bytes_by_id,
                "level": placement.level.name,
            },
            node=first.node,
            gpu=first.label,
            deployment=deployment.name,
            replica=replica.id,
        )
        wait_for = [e.replica_id for e in placement.evictions]
        if deployment.failover_standby and not promoted and replica.lease_id is None:
            failover.pair_up(deployment, replica)
        if promoted:
            dispatch.wake(first.node, replica.id, wait_for)
        elif replica.lease_id is None:
            # Built now from the row as written and the GPUs' own contexts: the command the
            # committed books would give, without reading them back after the commit.
            views = [gpus[g] for g in placement.gpu_ids]
            contexts = (max(v.context_bytes for v in views), max(v.standby_context_bytes for v in views))
            command = replica_specs.start_placed(replica, contexts=contexts, virtual=first.virtual, wait_for=wait_for)
            dispatch.start_placed(first.node, command)
        else:
            dispatch.start(first.node, replica.id, wait_for)


def _replicas_in_pk_order(ids: set[str]) -> list[Replica]:
    return list(Replica.objects.select_related("node", "deployment").filter(id__in=ids).order_by("pk"))


def _mark_evicted(victim: Replica, placement: Placement) -> None:
    replica_services.set_state(
        victim, Replica.State.DRAINING, f"evicted to the CPU cache to make room: {placement.reason}"
    )
    if victim.node is not None:
        dispatch.sleep(victim.node.name, victim.id)
        if victim.node.cpu_cache_bytes > 0:  # its weights go to the node's host memory
            dispatch.trim_host_cache(victim.node.name)


def _stop_replicas(
    deployment: Deployment,
    replica_ids: list[str],
    *,
    reason: str,
    known: dict[str, tuple[str, str | None]] | None = None,
) -> None:
    """Release and stop the replicas (a failover pair whole). `known`: each one's state and node
    name as the caller read them under the deployment's lock, so they need not be read again."""
    ids = set(replica_ids)
    if deployment.failover_standby:  # only such a deployment's replicas are paired (a setting it keeps)
        ids |= failover.partners(ids)  # a pair stops whole: its standby must not take over
    if known is not None and not ids <= set(known):
        known = None

    def apply(plan: Plan | None = None) -> None:
        if known is not None:
            # One update per replica, in primary-key order (the global lock order).
            for replica_id in sorted(ids):
                state, node = known[replica_id]
                replica_services.set_state_of(
                    replica_id, state, Replica.State.STOPPING, f"stopping: {reason}", node=node, deployment=deployment
                )
                if node is not None:
                    dispatch.stop(node, replica_id, drain_timeout_s=deployment.drain_timeout_s)
        else:
            for replica in Replica.objects.select_related("node", "deployment").filter(id__in=ids).order_by("pk"):
                replica_services.set_state(replica, Replica.State.STOPPING, f"stopping: {reason}")
                if replica.node is not None:
                    dispatch.stop(replica.node.name, replica.id)
        if deployment.failover_standby:
            # The stops go out on commit, this with them: no member takes over from one that exits.
            failover.close_pairs(ids)

    if ledger.commit_with_retry(releasing(ids, reason), apply=apply) is None:
        apply()  # nothing was reserved (e.g. still pending): stop them all the same


def popular_warnings() -> list[str]:
    """What the API tells an operator who marks deployments popular: GPUs left with no room."""
    snap = ledger.snapshot()
    others = [d for d in Deployment.objects.filter(popular=False) if d.memory_need_bytes]
    smallest = min((d.memory_need_bytes for d in others), default=None)
    return fairness.popular_crowding(list(snap.gpus.values()), smallest_other_need=smallest)
