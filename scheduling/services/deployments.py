"""Deploy, change, evict and delete deployments: snapshot → plan → commit → dispatch. Scaling is
services/scaling.py's (`scale` is named here too, where the API's callers find it); placing and
stopping replicas, services/placing.py's.

Lock order, the same everywhere (so two services never wait on each other in a cycle):
the deployment row, then GPU rows in primary-key order (the ledger), then replica rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field, make_dataclass, replace
from datetime import timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from gpuportal.wire import adapters, deployment_spec, memory, node_labels
from gpuportal.wire.states import DeploymentStatus
from scheduling import hot_sql, ledger, locks
from scheduling.core import effects, fairness
from scheduling.models import GPU, Deployment, DeploymentObserved, DeploymentRevision, Event, Replica
from scheduling.services import dispatch, not_found, outbox, queueing, revisions, rollouts
from scheduling.services import replicas as replica_services
from scheduling.services.errors import AlreadyExists, CannotPlace, InvalidInput, InvalidState
from scheduling.services.forgetting import forget_deployment
from scheduling.services.observing import save_observed
from scheduling.services.placing import COUNTED, PAIR_LIVE, PLAIN_COUNTED, add_replicas, releasing
from scheduling.services.scaling import scale

# A validated deployment as a user asked for it: its name, then every setting of
# gpuportal.wire.deployment_spec by its spec name (the REST shape of docs/api.md, flattened), each
# with the spec's default. Made from the spec, so a setting is declared there alone.
DeploymentSpec = make_dataclass(
    "DeploymentSpec",
    [
        ("name", str),
        *(
            (s.name, (s.type | None) if s.nullable else s.type, field() if s.required else field(default=s.default))
            for s in deployment_spec.SETTINGS
        ),
    ],
    frozen=True,
)
DeploymentSpec.__module__ = __name__

# The columns a PATCH writes, by spec name: the settings that change in place (the rest scale,
# or cannot change: deployment_spec.Update).
MUTABLE = {s.name: s.column for s in deployment_spec.SETTINGS if s.stored}
# What a PATCH scales to (the replica count), and what it may only send back unchanged.
SCALED = {s.name: s for s in deployment_spec.SETTINGS if s.update == deployment_spec.Update.SCALE}
KEPT = {s.name: s for s in deployment_spec.SETTINGS if s.update == deployment_spec.Update.REFUSED_IF_CHANGED}


@dataclass(frozen=True)
class ModelFacts:
    weight_bytes: int
    estimate_bytes: int
    detail: str = ""


def inspect_model(source: str, loader: str, dtype: str, max_tokens: int, adapters: str = "") -> ModelFacts:
    """Weight bytes and the estimated need, without loading weights: a node agent reads the
    files (never this process), the estimate is the control plane's. Bad sources
    name the field. The adapters' stacks count as weights: the replica holds them beside its own."""
    reading = dispatch.inspect(source, loader, dtype, adapters)
    if reading.refusal:
        raise InvalidInput(reading.refused, reading.refusal)
    if reading.shape is not None:
        shape = replace(reading.shape, weight_bytes=reading.shape.weight_bytes + reading.adapter_bytes)
        estimate = memory.estimate(shape, max_tokens=max_tokens, cuda_context_bytes=0)
        return ModelFacts(shape.weight_bytes, estimate.total_bytes, estimate.describe())
    weights = reading.weight_bytes
    return ModelFacts(weights, weights + memory.ACTIVATION_FLOOR_BYTES, "weights + activation floor")


def get(name: str, *, lock: bool = False) -> Deployment:
    if lock:
        return locks.lock_deployment(name)
    try:
        return Deployment.objects.select_related("observed").get(name=name)
    except Deployment.DoesNotExist:
        raise not_found.deployment(name) from None


@locks.retry_deadlocks
def create(spec: DeploymentSpec, *, facts: ModelFacts | None = None, by: str = "") -> Deployment:
    """Create the deployment and place all its replicas, or nothing at all (409 with reasons)."""
    _check_together({s.name: getattr(spec, s.name) for s in deployment_spec.SETTINGS})
    if memory.POLICIES.get(spec.memory_policy) is None:
        known = " or ".join(memory.POLICIES)
        raise InvalidInput("memory.policy", f"unknown policy {spec.memory_policy!r} ({known})")
    _check_source(spec.source, spec.loader)
    taken = AlreadyExists("name", f"a deployment named {spec.name!r} already exists")
    if Deployment.objects.filter(name=spec.name).exists():
        raise taken  # before asking a node to read the model
    facts = facts or inspect_model(spec.source, spec.loader, spec.dtype, spec.max_tokens, spec.adapters)
    # Its Events are written in one statement at the end (the savepoint's error below ends the call).
    with transaction.atomic(), outbox.gathered():
        try:
            # A savepoint: a create of the same name that committed since the check above makes
            # this insert fail on the unique name, which is a 409 like the check's, not a 500.
            with transaction.atomic():
                deployment = _insert(spec, facts)
        except IntegrityError:
            raise taken from None
        outbox.note(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {spec.name}",
            f"created{_by(by)} with {spec.replicas} replica(s) of {spec.source} ({spec.loader}, {spec.dtype}); "
            f"estimated need {memory.human_bytes(facts.estimate_bytes)}: {facts.detail}".rstrip(": "),
            after={"replicas": spec.replicas, "estimate_bytes": facts.estimate_bytes},
            deployment=spec.name,
            console=True,
        )
        revisions.record(deployment, revisions.DEPLOYED, by=by)
        if spec.replicas:
            # A deployment this transaction made has no replica yet: no sleeping one to promote,
            # no parked one to retire (two queries fewer).
            add_replicas(deployment, spec.replicas, reason=f"deploy {spec.name}", cached=(), parked=False)
    return deployment


def _check_source(source: str, loader: str) -> None:
    if loader == Deployment.Loader.TORCH_MODULE and not torch_module_allowed(source):
        listed = ", ".join(settings.GPUPORTAL_TORCH_MODULES) or "none"
        raise InvalidInput(
            "model.source",
            f"{source!r} is code the nodes would run: only modules an operator lists in "
            f"GPUPORTAL_TORCH_MODULES may be deployed (listed: {listed})",
        )


def torch_module_allowed(source: str) -> bool:
    """Whether `source` (package.module:factory) is in a module an operator allowed."""
    module = source.partition(":")[0]
    return any(module == allowed or module.startswith(f"{allowed}.") for allowed in settings.GPUPORTAL_TORCH_MODULES)


def _insert(spec: DeploymentSpec, facts: ModelFacts) -> Deployment:
    """The deployment's row and its observed record, which every deployment has from its start:
    what was read of its model is the first thing the portal knows about it."""
    deployment = Deployment.objects.create(
        name=spec.name, **{s.column: getattr(spec, s.name) for s in deployment_spec.SETTINGS}
    )
    # Cached on the deployment as it is made: placing its replicas below reads it.
    DeploymentObserved.objects.create(
        deployment=deployment, memory_estimate_bytes=facts.estimate_bytes, weight_bytes=facts.weight_bytes
    )
    return deployment


def update(name: str, changes: dict[str, Any], *, by: str = "") -> Deployment:
    """Change settings (and the replica count, through scale). Unknown fields are a caller bug."""
    return _update(name, changes, by=by).deployment


@dataclass(frozen=True)
class Rollback:
    deployment: Deployment
    to: DeploymentRevision  # the revision returned to
    revision: DeploymentRevision | None  # the one the rollback made; None when nothing differed
    changes: dict[str, tuple[Any, Any]]  # by path: (before, after)


# How often a rollback reads its target again when changes keep landing between its read and
# its lock; past that the caller is told to try again (409).
ROLLBACK_TRIES = 3


class _Moved(Exception):
    """A change committed between a rollback's read of its target and its lock."""


def rollback(name: str, number: int | None = None, *, by: str = "") -> Rollback:
    """Return the deployment's settings to revision `number` (None: the one before the current),
    as a change through `update`: a new revision on top, a rolling restart where the model or
    its dtype goes back. The replica count stays. InvalidInput naming `revision` for one not
    kept; nothing changes (and no revision is made) where the settings are already its."""
    for _ in range(ROLLBACK_TRIES):
        # Read before the lock (a changed model is read by a node agent first, as any change's),
        # and committed only while the newest revision is the one read: "the one before the
        # current" means the current as the rollback commits, never one a change replaced meanwhile.
        to = revisions.target(get(name), number)
        cause = f"rolled back to revision {to.revision.number}"
        try:
            done = _update(name, revisions.restored(to.revision), by=by, cause=cause, based_on=to.newest)
        except _Moved:
            continue
        changes = {deployment_spec.BY_NAME[key].path: pair for key, pair in done.changes.items()}
        return Rollback(done.deployment, to.revision, done.revision, changes)
    raise InvalidState(f"deployment {name!r} changed {ROLLBACK_TRIES} times while rolling back; try again")


def load_adapter(model: str, source: str, *, by: str = "") -> Deployment:
    """Serve one more LoRA adapter, named by its model id (`deployment:adapter`, as vLLM's
    `/v1/load_lora_adapter` names it), from `source`: a change of the deployment's
    `model.adapters` (checked, estimated and rolled out as any), on top of whatever it is as it
    commits. InvalidInput naming `lora_name` for an id that names no adapter or one served."""
    deployment_name, name = _adapter_named(model)

    def added(served: dict[str, str]) -> dict[str, str]:
        if name in served:
            raise InvalidInput("lora_name", f"deployment {deployment_name!r} serves adapter {name!r} already")
        return {**served, name: source}

    return _change_adapters(deployment_name, added, by=by, cause=f"adapter {name} loaded")


def unload_adapter(model: str, *, by: str = "") -> Deployment:
    """Serve one adapter fewer (vLLM's `/v1/unload_lora_adapter`); NotFound for one not served."""
    deployment_name, name = _adapter_named(model)

    def removed(served: dict[str, str]) -> dict[str, str]:
        if name not in served:
            raise not_found.adapter(deployment_name, name, list(served))
        return {key: value for key, value in served.items() if key != name}

    return _change_adapters(deployment_name, removed, by=by, cause=f"adapter {name} unloaded")


def _adapter_named(model: str) -> tuple[str, str]:
    deployment_name, name = adapters.split_model(model)
    if name is None:
        raise InvalidInput("lora_name", f"name the adapter as deployment{adapters.SEPARATOR}adapter (it was {model!r})")
    return deployment_name, name


def _change_adapters(name: str, edit: Callable[[dict[str, str]], dict[str, str]], *, by: str, cause: str) -> Deployment:
    """`edit` of the deployment's adapters as they stand when the change commits: another change
    that commits between its read and its lock is read again, as a rollback's is (a load beside
    another load keeps both)."""
    for _ in range(ROLLBACK_TRIES):
        deployment = get(name)
        newest = revisions.newest(deployment)
        text = adapters.written(edit(adapters.parse(deployment.model_adapters)))
        try:
            return _update(name, {"adapters": text}, by=by, cause=cause, based_on=newest).deployment
        except _Moved:
            continue
    raise InvalidState(f"deployment {name!r} changed {ROLLBACK_TRIES} times while its adapters changed; try again")


@dataclass(frozen=True)
class _Updated:
    deployment: Deployment
    changes: dict[str, tuple[Any, Any]]  # by spec name: (before, after), the stored settings that changed
    revision: DeploymentRevision | None


def _by(by: str) -> str:
    """Who asked, as a deployment's Events say it (as its revisions keep it)."""
    return f" by {by}" if by else ""


@locks.retry_deadlocks
def _update(
    name: str, changes: dict[str, Any], *, by: str, cause: str = revisions.CHANGED, based_on: int | None = None
) -> _Updated:
    """`update`'s work; `cause`: the revision's, which its Event begins with, and who asked;
    `based_on`: the newest revision number the changes were read against (_Moved where another
    is newest under the lock, nothing written)."""
    unknown = set(changes) - set(MUTABLE) - set(SCALED) - set(KEPT)
    if unknown:
        raise InvalidInput(sorted(unknown)[0], "cannot be changed on an existing deployment")
    changes = dict(changes)
    # Before any lock: a node agent reads the model's files, as at its deploy.
    estimate = _estimate_for(name, changes)
    rolling, revision = 0, None
    with transaction.atomic():
        deployment = get(name, lock=True)
        if based_on is not None and revisions.newest(deployment) != based_on:
            raise _Moved
        for key, setting in KEPT.items():
            if key in changes and changes.pop(key) != getattr(deployment, setting.column):
                # Failover, for one: its replicas run without a pair's lock (or hold one); pairing
                # them up, or splitting them, would need every process restarted; a new
                # deployment says so honestly.
                raise InvalidInput(
                    setting.path, "cannot be changed on an existing deployment; create a new deployment instead"
                )
        _check_together(
            {s.name: changes.get(s.name, getattr(deployment, s.column)) for s in deployment_spec.SETTINGS},
            changes,
        )
        settings_before = revisions.settings_of(deployment)
        before = {key: getattr(deployment, MUTABLE[key]) for key in changes if key in MUTABLE}
        after = {key: value for key, value in changes.items() if key in MUTABLE and before[key] != value}
        for key, value in after.items():
            setattr(deployment, MUTABLE[key], value)
        if after:
            deployment.save()
            outbox.note(
                Event.Kind.DEPLOYMENT_CHANGED,
                f"deployment {name}",
                # Each by its place in the REST body, as the caller named it.
                f"{cause}{_by(by)}: "
                + ", ".join(
                    f"{deployment_spec.BY_NAME[k].path} {before[k]!r} → {v!r}{_when(k)}" for k, v in after.items()
                )
                + (_misplaced(deployment) if after.keys() & PLACING else ""),
                before={k: before[k] for k in after},
                after=after,
                deployment=name,
            )
            revision = revisions.record(deployment, cause, by=by, before=settings_before)
            if after.keys() & PLACING:
                # What its nodes' NoExecute taints no longer let it run there is moved off by the
                # reconcile (scheduling.services.node_marks.evict_untolerated), and what it lacks
                # may go where it is allowed now.
                placed = f"deployment {name}'s placement changed"
                outbox.want(effects.to_control(replica_services.RECONCILE_TASK, placed))
            if estimate is not None and after.keys() & ESTIMATED:
                _estimate_anew(deployment, estimate)
            rolled = [deployment_spec.BY_NAME[k].path for k in after if k in ROLLED]
            # Before a retry places what a failed deployment lacks: what it places follows the change.
            if rolled:
                rolling = rollouts.begin(deployment, why=f"for the new {' and '.join(rolled)}", park_asleep=True)
            if deployment.observed.failed_reason:
                # A changed spec is the operator's answer to the failure: try again.
                retry(name, reason="its settings changed")
        for key in SCALED:
            if key in changes:
                scale(name, changes[key])
    if rolling:
        rollouts.advance(name)  # its first steps, as a restart takes them: the answer shows them
    _reread(deployment)
    return _Updated(deployment, {key: (before[key], value) for key, value in after.items()}, revision)


def _check_together(values: dict[str, Any], changed: Collection[str] = ()) -> None:
    """What no one setting's bounds can say, and a text setting's own syntax (its `check`, which
    the API's input and the CLI ran already: here for every other caller): InvalidInput naming
    the setting at fault."""
    for setting in deployment_spec.SETTINGS:
        if setting.check is not None and isinstance(value := values.get(setting.name), str):
            try:
                setting.check(value)
            except ValueError as err:
                raise InvalidInput(setting.path, str(err)) from None
    if (problem := deployment_spec.autoscale_problem(values, changed)) is not None:
        raise InvalidInput(*problem)
    if (problem := deployment_spec.adapters_problem(values)) is not None:
        raise InvalidInput(*problem)


# What the estimate of a replica's need is made from: a change of any reads the model again.
ESTIMATED = frozenset({"source", "dtype", "max_tokens", "adapters"})
# What a running replica cannot follow: a change starts a rolling restart.
ROLLED = frozenset(s.name for s in deployment_spec.SETTINGS if s.update == deployment_spec.Update.ROLLOUT)


def _estimate_for(name: str, changes: dict[str, Any]) -> ModelFacts | None:
    """The model read again (by a node agent, as at its deploy) for a changed source, dtype or
    `max_tokens` (whose KV pool the estimate sizes): a source no node can read is a 400 naming
    it before anything changes. None when none of them changes."""
    if not changes.keys() & ESTIMATED:
        return None
    current = get(name)
    now = {key: getattr(current, MUTABLE[key]) for key in ESTIMATED}
    wanted = {**now, **{key: changes[key] for key in ESTIMATED if key in changes}}
    if wanted == now:
        return None
    _check_source(wanted["source"], current.loader)
    return inspect_model(wanted["source"], current.loader, wanted["dtype"], wanted["max_tokens"], wanted["adapters"])


def _estimate_anew(deployment: Deployment, facts: ModelFacts) -> None:
    """The need for the new model, dtype or `max_tokens` (the caller holds the deployment's
    lock): its estimate, and no measurement, since the one kept was of other weights or a KV pool
    sized for the old figure. Replicas placed from now on reserve the estimate until one measures
    its own; those running keep theirs."""
    record = deployment.observed
    was, measured = record.memory_estimate_bytes, record.memory_measured_bytes
    record.memory_estimate_bytes, record.weight_bytes = facts.estimate_bytes, facts.weight_bytes
    record.memory_measured_bytes = record.memory_measured_context_bytes = None
    fields = ["memory_estimate_bytes", "weight_bytes", "memory_measured_bytes", "memory_measured_context_bytes"]
    save_observed(deployment, fields)
    dropped = f"; the need measured before ({memory.human_bytes(measured)}) is dropped" if measured else ""
    outbox.note(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        f"estimated need {memory.human_bytes(facts.estimate_bytes)} for {deployment.model_source} "
        f"({deployment.dtype}) at max_tokens {deployment.max_tokens} (was {memory.human_bytes(was or 0)}){dropped}: "
        "replicas placed from now on reserve it",
        before={"estimate_bytes": was, "measured_bytes": measured},
        after={"estimate_bytes": facts.estimate_bytes, "measured_bytes": None},
        deployment=deployment.name,
    )


def _reread(deployment: Deployment) -> None:
    """The deployment as committed, its observed record with it (the answer shows both). A delete
    committed since this call's own change is a 404, as it would have been a moment earlier."""
    try:
        deployment.refresh_from_db(from_queryset=Deployment.objects.select_related("observed"))
    except Deployment.DoesNotExist:
        raise not_found.deployment(deployment.name) from None


# The settings that say which nodes a deployment may use: a change of them may leave replicas
# where it now refuses them.
PLACING = {"node_selector", "tolerations"}


def _misplaced(deployment: Deployment) -> str:
    """What the Event of a changed node selector or tolerations says of the replicas they leave
    on nodes they refuse now: those a node's NoExecute taint moves off, and how to move the
    others ("" for none)."""
    ids, _ = rollouts.misplaced_of(deployment)
    if not ids:
        return ""
    tolerated = node_labels.parse_tolerations(deployment.placement_tolerations)
    taints = Replica.objects.filter(pk__in=ids).values_list("node__taints", flat=True)
    evicted = sum(1 for held in taints if node_labels.evicting(held or {}, tolerated))
    said = ""
    if staying := len(ids) - evicted:
        said += (
            f"; {staying} replica(s) on nodes it now refuses stay there until moved "
            f"(gpuportal restart {deployment.name} --misplaced)"
        )
    if evicted:
        said += (
            f"; {evicted} replica(s) on nodes whose NoExecute taints it no longer tolerates are moved off, each "
            "replaced elsewhere before it stops"
        )
    return said


def _when(key: str) -> str:
    """When a changed setting takes effect, where it is not at once: an operator reading the
    Event should not expect running replicas to follow it."""
    if deployment_spec.BY_NAME[key].update == deployment_spec.Update.NEXT_REPLICA:
        return " (for replicas placed from now on)"
    if deployment_spec.BY_NAME[key].update == deployment_spec.Update.ROLLOUT:
        return " (every replica rolled onto it, one at a time)"
    return ""


# -- crash-loop backoff ---------------------------------------------------------------------------

REPLACE_TASK = "scheduling.tasks.replace_failed"


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
    record = deployment.observed
    record.load_failures += 1
    failures, limit = record.load_failures, deployment.max_load_failures
    if failures >= limit:
        record.failed_reason = reason
        record.retry_at = None
        save_observed(deployment, ["load_failures", "failed_reason", "retry_at"])
        outbox.note(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {deployment.name}",
            f"failed: {failures} load(s) in a row failed, the last (replica {replica_id[:8]}): {reason}; "
            f"nothing more starts until it is retried (POST /api/deployments/{deployment.name}/retry/) "
            "or its settings change",
            after={"status": DeploymentStatus.FAILED, "load_failures": failures},
            deployment=deployment.name,
            replica=replica_id,
            console=True,
        )
        return False
    delay = backoff_s(deployment, failures)
    record.retry_at = timezone.now() + timedelta(seconds=delay)
    save_observed(deployment, ["load_failures", "retry_at"])
    outbox.note(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        f"load {failures} of at most {limit} in a row failed (replica {replica_id[:8]}): {reason}; "
        f"a replacement starts in {delay:g} s",
        after={"load_failures": failures, "retry_in_s": delay},
        deployment=deployment.name,
        replica=replica_id,
    )
    outbox.want(effects.to_control(REPLACE_TASK, deployment.name, countdown=delay))
    return True


def note_loaded(deployment: Deployment) -> None:
    """A replica loaded: the failures in a row are over (the caller holds the row)."""
    record = deployment.observed
    if record.load_failures or record.retry_at or record.failed_reason:
        record.load_failures, record.retry_at, record.failed_reason = 0, None, ""
        save_observed(deployment, ["load_failures", "retry_at", "failed_reason"])


def replace_failed(name: str) -> list[str]:
    """The backoff of a failed load is over: place what the deployment lacks (its replicas, or
    one for the requests that wait when it wants none awake). Returns the replicas placed."""
    with transaction.atomic():
        deployment = locks.lock_deployment_if_there(name=name)
        if deployment is None or deployment.observed.failed_reason or deployment.observed.retry_at is None:
            return []  # deleted, given up, or retried by hand meanwhile
        deployment.observed.retry_at = None
        save_observed(deployment, ["retry_at"])
        wanted = deployment.replicas_wanted or (1 if _requests_wait(name) else 0)
        return _top_up(
            deployment,
            wanted,
            f"replacing a failed load ({deployment.observed.load_failures} in a row) after its backoff",
        )


def reconcile(name: str, reason: str) -> list[str]:
    """Keep what the operator asked for: place what the deployment lacks of its
    `replicas`, sleeping ones counted, never stopping any. Not while a failed load waits out its
    backoff, nor once it gave up. Returns the replicas placed."""
    with transaction.atomic(durable=True):  # a boundary: its callers hold no transaction
        deployment = locks.lock_deployment_if_there(name=name)
        if deployment is None or deployment.observed.failed_reason or deployment.observed.retry_at is not None:
            return []
        return _top_up(deployment, deployment.replicas_wanted, reason)


def reconcile_all(reason: str) -> dict[str, list[str]]:
    """`reconcile` every deployment that has fewer replicas than it wants: one query to find them."""
    short = (
        Deployment.objects.filter(observed__failed_reason="", observed__retry_at__isnull=True, replicas_wanted__gt=0)
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
        outbox.note(
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
        record = deployment.observed
        was = record.failed_reason
        record.load_failures, record.failed_reason = 0, ""
        record.retry_at = timezone.now()  # due now: replace_failed below places at once
        save_observed(deployment, ["load_failures", "failed_reason", "retry_at"])
        outbox.note(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {name}",
            f"{reason}: load failures cleared" + (f" (it had failed: {was})" if was else ""),
            before={"status": DeploymentStatus.FAILED if was else DeploymentStatus.OK},
            after={"status": "ok"},
            deployment=name,
        )
        replace_failed(name)
    _reread(deployment)
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
    with transaction.atomic(), outbox.gathered():
        # Its row locked and its replicas read in statements the server keeps prepared.
        found, (replicas,) = locks.lock_deployments_reading([name], hot_sql.statement("replicas_of"))
        if not found:
            raise not_found.deployment(name)
        deployment = found[0]
        ledger.commit_with_retry(
            releasing({replica_id for replica_id, _, _ in replicas}, f"{reason}: deployment {name}")
        )
        for replica_id, state, node in replicas:
            if node is not None and state not in (Replica.State.STOPPED, Replica.State.FAILED):
                # The drain as the row says it now: after the commit there is no row to read it from.
                # A failover pair goes whole: its standby must not take over from the active.
                outbox.want(
                    effects.stop(
                        node,
                        replica_id,
                        drain_timeout_s=deployment.drain_timeout_s,
                        close_pair=deployment.failover_standby,
                    )
                )
        outbox.note(
            Event.Kind.DEPLOYMENT_CHANGED,
            f"deployment {name}",
            f"{reason}: {len(replicas)} replica(s) stopped and their reservations released",
            before={"replicas": len(replicas)},
            deployment=name,
            console=True,
        )
        # One statement for the cascade Django's collector runs in about ten (scheduling.services.forgetting).
        _note_wake_locks_dropped(name, forget_deployment(deployment.pk), reason)
        # Nothing will ever serve what still waits in its queue: end it now, saying why (once the
        # delete has committed). Requests already taken finish first: stopping waits for them.
        outbox.want(
            effects.AfterCommit(
                f"end the requests waiting for {name}",
                lambda: queueing.fail_waiting(name, f"deployment {name} was deleted", deleted=True),
            )
        )


def _note_wake_locks_dropped(name: str, dropped: list[tuple[int, str]], reason: str) -> None:
    """The wake locks its replicas held, which went with them ((GPU id, holder) as
    forget_deployment cleared them): said, as every release of one is."""
    holders = dict(dropped)
    for gpu in GPU.objects.filter(pk__in=list(holders)).select_related("node").order_by("pk"):
        label, holder = f"{gpu.node.name}/{gpu.index}", holders[gpu.pk]
        outbox.note(
            Event.Kind.GPU_WAKE_LOCK,
            f"gpu {label}",
            f"wake lock released by {name} ({holder[:8]}): its deployment was {reason}",
            before={"holder": holder},
            after={"holder": None},
            node=gpu.node.name,
            gpu=label,
            deployment=name,
            replica=holder,
        )


def popular_warnings() -> list[str]:
    """What the API tells an operator who marks deployments popular: GPUs left with no room."""
    snap = ledger.snapshot()
    others = [d for d in Deployment.objects.filter(popular=False).select_related("observed") if d.memory_need_bytes]
    smallest = min((d.memory_need_bytes for d in others), default=None)
    return fairness.popular_crowding(list(snap.gpus.values()), smallest_other_need=smallest)
