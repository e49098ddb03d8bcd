"""Rolling restarts: every replica of a deployment replaced, one at a time (a failover pair's
members through a new standby and a switchover, or by a new pair beside them where the need has
outgrown their reservation), with no request lost (scheduling.core.rollout decides each step).
`restart` starts one and takes its first step; `advance` takes the next, from the beat's sweep
every few seconds (`advance_all`), each in a transaction of its own under the deployment's row
lock, so two sweeps never take a step twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpuportal.wire import node_labels, states
from gpuportal.wire.states import Rollout
from scheduling import locks
from scheduling.core import rollout
from scheduling.core.rollout import Action, Member, Step
from scheduling.models import GPU, Deployment, DeploymentObserved, Event, Node, Occupant, Replica
from scheduling.services import failover, host_cache, outbox
from scheduling.services import replicas as replica_services
from scheduling.services.errors import CannotPlace, InvalidState
from scheduling.services.observing import save_observed
from scheduling.services.placing import Stop, add_replicas, need_with, node_refusals, release_and_stop

STEP = "rolling restart"
# A restart of some replicas alone (a drain's, a taint's, a placement's): its Events say so.
MOVE = "move"


def members(replicas: list[Replica], *, paired: bool) -> list[Member]:
    """The replicas a restart counts, from rows already read, ended ones gone. In a deployment of
    failover pairs (`paired`) each member with its pair, standbys included, since a restart
    replaces them too; elsewhere a standby is none (it cannot be: only such a deployment pairs)."""
    return [
        Member(r.id, r.state, r.created_at, r.lease_id if paired else None)
        for r in replicas
        if (paired or r.role != Replica.Role.STANDBY) and r.state not in states.GONE
    ]


def progress_of(deployment: Deployment) -> rollout.Progress | None:
    """How far the deployment's restart is (None: none under way), from its prefetched replicas."""
    since = deployment.observed.restart_since
    if since is None:
        return None
    found = members(list(deployment.replicas.all()), paired=deployment.failover_standby)
    return rollout.progress(found, since, _only(deployment))


def misplaced_of(deployment: Deployment) -> tuple[list[str], str]:
    """The deployment's replicas (those holding a process, a host copy or memory) on nodes its
    `placement.node_selector` or `placement.tolerations` refuse now, and why, node by node."""
    refused = node_refusals(deployment)
    held = deployment.replicas.exclude(state__in=[*states.GONE, Replica.State.PARKED]).filter(
        node__name__in=list(refused)
    )
    rows = list(held.order_by("created_at", "id").values_list("id", "node__name"))
    why = "; ".join(f"{node}: {refused[node]}" for node in sorted({node for _, node in rows}))
    return [replica_id for replica_id, _ in rows], why


def _with_their_pairs(replica_ids: Iterable[str]) -> list[str]:
    """These replicas and the other members of their failover pairs: a pair moves whole."""
    ids = set(replica_ids)
    leases = Replica.objects.filter(pk__in=ids, lease__isnull=False).values_list("lease_id", flat=True)
    ids |= set(Replica.objects.filter(lease_id__in=list(leases)).values_list("id", flat=True))
    return sorted(ids)


def _named(deployment: Deployment) -> str:
    """What the deployment's restart under way is called in its Events: a move, or a restart."""
    return MOVE if deployment.observed.restart_only else STEP


def _only(deployment: Deployment) -> frozenset[str] | None:
    """A move's replicas (the only ones its restart replaces); None for a whole restart."""
    return frozenset(deployment.observed.restart_only.split()) or None


@locks.retry_deadlocks
def restart(name: str, *, by: str, misplaced: bool = False) -> Deployment:
    """Start a rolling restart of the deployment and take its first step. InvalidState (409) for a
    deployment that has failed, is being restarted, or has nothing to restart. `misplaced`: only
    its replicas on nodes its placement refuses now (`misplaced_of`: a node selector or
    tolerations changed since, or a node's labels or taints), moved as a drain's are."""
    with transaction.atomic():
        deployment = locks.lock_deployment(name)
        observed = deployment.observed
        if observed.failed_reason:
            raise InvalidState(
                f"deployment {name} has failed ({observed.failed_reason}): retry it rather than restart it"
            )
        if observed.restart_since is not None:
            done = progress_of(deployment)
            raise InvalidState(
                f"a rolling restart of {name} is under way since {observed.restart_since.isoformat()} "
                f"({done.replaced} replica(s) started since, {done.left} to replace): wait for it to end"  # type: ignore[union-attr]
            )
        if misplaced:
            ids, why = misplaced_of(deployment)
            if not ids:
                raise InvalidState(f"no replica of {name} is on a node its placement refuses: nothing to move")
            why = f"of the replicas where its placement refuses them, asked by {by} ({why})"
            begin(deployment, why=why, only=_with_their_pairs(ids))
        elif not begin(deployment, why=f"asked by {by}"):
            raise InvalidState(
                f"deployment {name} has no replica to restart: none holds a process, a host copy or GPU memory "
                "(a parked replica's next wake loads it anew)"
            )
    advance(name)
    return deployment


@locks.retry_deadlocks
def move(name: str, replica_ids: Iterable[str], *, why: str) -> int:
    """Replace these replicas of the deployment (those serving on a node drained with a move) by
    new ones placed where placement may put them, each stopped once its replacement serves: a
    restart of them alone (a failover pair's active member, by a whole new pair placed beside
    its pair). Returns how many it is to move; 0 when it cannot (a restart under way, a failed
    deployment), and the caller leaves them as a drain without a move would."""
    with transaction.atomic():
        deployment = locks.lock_deployment_if_there(name=name)
        if deployment is None or deployment.observed.restart_since is not None or deployment.observed.failed_reason:
            return 0
        count = begin(deployment, why=why, only=_with_their_pairs(replica_ids))
    if count:
        advance(name)
    return count


def stay_on(node: str, *, why: str) -> dict[str, int]:
    """A node back in service (an undrain) keeps what the moves under way have still to move off
    it, but for the replicas their placement refuses there (a selector, a taint: those move on).
    A move left with nothing to move ends, and the replacement it had on its way stops (it would
    be one replica too many beside the one that stays). Returns {deployment: replicas kept}."""
    names = (
        DeploymentObserved.objects.filter(restart_since__isnull=False)
        .exclude(restart_only="")
        .values_list("deployment__name", flat=True)
    )
    return {name: count for name in sorted(names) if (count := _stay_on(name, node, why))}


@locks.retry_deadlocks
def _stay_on(name: str, node: str, why: str) -> int:
    with transaction.atomic():
        # Under the deployment's row, as every step of a move is taken: the beat's sweep cannot
        # place a replacement for a replica this leaves where it is.
        deployment = locks.lock_deployment_if_there(name=name)
        if deployment is None or not deployment.observed.restart_only:
            return 0
        observed = deployment.observed
        moving = observed.restart_only.split()
        live = Replica.objects.filter(pk__in=moving).exclude(state__in=states.GONE)
        if node in node_refusals(deployment):
            return 0  # its placement refuses the node: what is there moves on
        staying = set(_with_their_pairs(live.filter(node__name=node).values_list("id", flat=True)))
        if not staying:
            return 0
        observed.restart_only = " ".join(i for i in moving if i not in staying)
        said = f"{MOVE} off node {node}: {why}; {len(staying)} replica(s) stay there"
        if live.exclude(pk__in=staying).exists():
            # Others elsewhere still move; a replacement on its way replaces one of them.
            save_observed(deployment, ["restart_only"])
            outbox.note(Event.Kind.DEPLOYMENT_CHANGED, f"deployment {name}", said, deployment=name)
            return len(staying)
        surge = observed.restart_surge
        if surge and Replica.objects.filter(pk=surge).exclude(state__in=states.GONE).exists():
            # Kept, it would be one replica too many beside those that stay (a pair, whole).
            release_and_stop(Stop.of(deployment, [surge], reason=f"{MOVE} ended: {why}; the replica it replaced stays"))
            said += f", and replacement {surge[:8]} stops"
        _end(deployment, f"{said}; nothing is left to move")
    return len(staying)


def begin(deployment: Deployment, *, why: str, park_asleep: bool = False, only: Iterable[str] = ()) -> int:
    """A rolling restart of the deployment from now, recorded in the caller's transaction (which
    holds the deployment's row); the caller takes its first step, or has it taken, after the commit.
    One under way already starts again from now, keeping the surge it has on its way (which then
    counts as the replacement of an outdated replica, and is itself replaced later). `park_asleep`:
    its sleepers parked at once, not in their turn (a new model: a wake meanwhile would serve the
    old one, and a deep sleeper's host copy is of the old weights). `only`: a move, which replaces
    those replicas alone (`move`). Returns how many replicas it is to replace; 0, and nothing
    recorded, when none holds a process, a host copy or GPU memory."""
    now = timezone.now()
    moving = sorted(only)
    left = rollout.outdated(_members_of(deployment), now, moving or None)
    if not left:
        return 0
    named = MOVE if moving else STEP
    if park_asleep:
        _park([m.id for m in left if m.state in states.ASLEEP], f"parked by a {named} {why}")
    deployment.observed.restart_since, deployment.observed.restart_only = now, " ".join(moving)
    save_observed(deployment, ["restart_since", "restart_only"])
    outbox.note(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        f"{named} {why}: {len(left)} replica(s) to {'move' if moving else 'replace'}, one at a time",
        after={"restart_since": now.isoformat(), "replicas": [m.id for m in left], "rollout": Rollout.BEGAN},
        deployment=deployment.name,
    )
    return len(left)


# The most steps one advance takes: a restart's steps until one waits (a stop-first and its
# replacement's placement; a surge's stop and the next surge), bounded so that a sweep of many
# deployments moves each of them on rather than one to its end.
STEPS_PER_ADVANCE = 4


def advance_all() -> dict[str, str]:
    """Every restart under way taken as far as it goes now: by deployment, the last step taken."""
    names = DeploymentObserved.objects.filter(restart_since__isnull=False).values_list("deployment__name", flat=True)
    taken = {name: advance(name) for name in sorted(names)}
    return {name: step.action.value for name, step in taken.items() if step is not None}


def advance(name: str) -> Step | None:
    """The deployment's restart taken as far as it goes now, a step per transaction, until a step
    waits or it is done: the last step taken (None: none under way, or the deployment went)."""
    last = None
    for _ in range(STEPS_PER_ADVANCE):
        taken = step(name)
        if taken is None:
            return last
        last = taken
        if taken.action in (Action.WAIT, Action.DONE):
            break
    return last


@locks.retry_deadlocks
def step(name: str) -> Step | None:
    """The next step of the deployment's restart (None: none under way, or the deployment went)."""
    with transaction.atomic():
        deployment = locks.lock_deployment_if_there(name=name)
        if deployment is None or deployment.observed.restart_since is None:
            return None
        observed = deployment.observed
        found = _members_of(deployment)
        if observed.failed_reason:
            left = len(rollout.outdated(found, observed.restart_since, _only(deployment)))
            why = (
                f"{_named(deployment)} stopped: its replacements failed to load ({observed.failed_reason}); "
                f"the {left} replica(s) started before it keep serving"
            )
            _end(deployment, why)
            return Step(Action.DONE, why=why)
        if observed.retry_at is not None:
            return Step(Action.WAIT, why="a failed load's replacement waits out its backoff")
        if observed.restart_surge and observed.restart_surge not in {m.id for m in found}:
            observed.restart_surge = ""  # it failed or was stopped (a scale-down): the next step places another
            save_observed(deployment, ["restart_surge"])
        if deployment.failover_standby:
            short = _short_pairs(deployment, found, observed.restart_since)
            decided = rollout.next_pair_step(
                found,
                since=observed.restart_since,
                surge_id=observed.restart_surge,
                short=short,
                only=_only(deployment),
            )
            if decided.action == Action.STANDBY and (ended := _standbys_keep_failing(deployment, decided)):
                return ended
        else:
            decided = rollout.next_step(
                found,
                since=observed.restart_since,
                surge_id=observed.restart_surge,
                wanted=deployment.replicas_wanted,
                only=_only(deployment),
            )
        return _take(deployment, decided, found)


def _members_of(deployment: Deployment) -> list[Member]:
    replicas = deployment.replicas.exclude(state__in=states.GONE).order_by("created_at", "id")
    return members(list(replicas), paired=deployment.failover_standby)


def _standbys_keep_failing(deployment: Deployment, decided: Step) -> Step | None:
    """The restart ends rather than start standby after standby for a pair whose standbys keep
    failing (past the limit, no takeover's or crash's replacement starts one either)."""
    lease_id = Replica.objects.filter(pk=decided.replica_ids[0]).values_list("lease_id", flat=True).first()
    failures = failover.failed_standbys(lease_id) if lease_id is not None else 0
    if failures <= settings.GPUPORTAL_MAX_RESTARTS_PER_HOUR:
        return None
    why = (
        f"{_named(deployment)} stopped: {failures} standbys of replica {decided.replica_ids[0][:8]}'s pair failed in "
        "the last hour; the pairs serve on, and `logs` on a failed standby says why"
    )
    _end(deployment, why)
    return Step(Action.DONE, why=why)


def _take(deployment: Deployment, decided: Step, found: list[Member]) -> Step:
    """The step taken: the one decided, or a stop where a surge found no room."""
    observed = deployment.observed
    named = _named(deployment)
    if decided.action == Action.DONE:
        replaced = sum(1 for m in found if m.created_at >= observed.restart_since)  # type: ignore[operator]
        _end(deployment, f"{named} done: {replaced} replica(s) started since it was asked for", outcome=Rollout.DONE)
    elif decided.action == Action.SURGE:
        (old,) = decided.replica_ids
        try:
            with transaction.atomic():  # a savepoint: nothing of a placement that cannot be made
                decision = add_replicas(
                    deployment, 1, reason=f"{named}: a replacement for replica {old[:8]}", cached=(), parked=False
                )
        except CannotPlace as err:
            if observed.restart_only:
                return _stays(deployment, old, err)
            if deployment.failover_standby:
                # A pair is never stopped before its replacement serves: that is what it is for.
                why = (
                    f"{named} stopped: no room for a new pair beside the pair of {old[:8]} ({err}); the pairs serve on"
                )
                _end(deployment, why)
                return Step(Action.DONE, why=why)
            why = f"no room for its replacement beside it, so it goes first ({err})"
            _stop(deployment, old, f"{named}: {why}")
            return Step(Action.STOP, (old,), why)
        observed.restart_surge = decision.new_ids[0]
        save_observed(deployment, ["restart_surge"])
    elif decided.action == Action.STOP:
        (old,) = decided.replica_ids
        _stop(deployment, old, f"{named}: {decided.why}")
        observed.restart_surge = ""
        save_observed(deployment, ["restart_surge"])
    elif decided.action == Action.PARK:
        _park(decided.replica_ids, f"parked by a {named}: {decided.why}")
    elif decided.action == Action.STANDBY:
        locks.lock_replica_ids(decided.replica_ids)  # after the deployment's row, in primary-key order
        rows = Replica.objects.select_related("node", "deployment").in_bulk(decided.replica_ids)
        active_id, *outdated = decided.replica_ids
        failover.renew_standby(rows[active_id], [rows[i] for i in outdated], reason=f"{named}: {decided.why}")
    elif decided.action == Action.SWITCHOVER:
        (active_id,) = decided.replica_ids
        failover.step_down(deployment, locks.lock_replica(active_id), reason=f"{named}: {decided.why}")
    elif decided.action == Action.TOP_UP:
        have = sum(1 for m in found if m.state in states.COUNTED)
        try:
            with transaction.atomic():
                add_replicas(
                    deployment,
                    deployment.replicas_wanted - have,
                    reason=f"{named}: {decided.why}",
                    cached=(),
                    parked=False,
                )
        except CannotPlace as err:
            why = (
                f"{named} stopped: no room to place what the deployment lacks of its {deployment.replicas_wanted} "
                f"replica(s) ({err}); those it has serve on, and the next reconcile or request places the rest"
            )
            _end(deployment, why)
            return Step(Action.DONE, why=why)
    return decided


def _short_pairs(deployment: Deployment, found: list[Member], since: datetime) -> set[int]:
    """The outdated pairs (their leases) that a restart in place would not fit (`_outgrown`),
    read in the step's own transaction, so the step taken for them is decided on what it reads."""
    actives = [m for m in found if m.pair is not None and m.created_at < since and m.state == Replica.State.SERVING]
    return {m.pair for m in actives if _outgrown(deployment, m.id)}  # type: ignore[misc]


def _outgrown(deployment: Deployment, active_id: str) -> bool:
    """Whether the deployment's need has outgrown the reservation of the active `active_id`'s
    pair (a larger `max_tokens` or `override_bytes` since it was placed): its new standby would
    wake into too little, after the active had stepped down. Such a pair is replaced by a new
    pair placed beside it, not in place."""
    active = Replica.objects.only("node_id", "gpu_mem_bytes_by_id").get(pk=active_id)
    indices = [int(index) for index in active.gpu_mem_bytes_by_id]
    gpus = GPU.objects.filter(node_id=active.node_id, index__in=indices)
    contexts = list(gpus.values_list("context_bytes", "standby_context_bytes"))
    if not contexts:
        return False
    need = need_with(deployment, (max(c for c, _ in contexts), max(s for _, s in contexts))).bytes
    return sum(Occupant.objects.filter(replica_id=active.pk).values_list("reserved_bytes", flat=True)) < need


def _park(replica_ids: Iterable[str], why: str) -> None:
    """These sleepers parked (scheduling.services.host_cache.park_sleeper); the caller holds their
    deployment's row."""
    for replica_id in sorted(replica_ids):  # after the deployment's row, in primary-key order: the one lock order
        replica = locks.lock_replica(replica_id)
        if replica.state in states.ASLEEP and replica.node is not None:
            host_cache.park_sleeper(replica, why)


def _stop(deployment: Deployment, replica_id: str, why: str) -> None:
    """The replica's reservation released and its process told to stop once it has finished what
    it took (its drain timeout); requests still queued wait for the others, or for its replacement."""
    release_and_stop(Stop.of(deployment, [replica_id], reason=why))


def _stays(deployment: Deployment, replica_id: str, err: CannotPlace) -> Step:
    """A move whose replacement for `replica_id` finds no room elsewhere: a move never stops a
    replica before its replacement serves, so it is left out of the move, and on a drained node
    it goes to sleep there as a drain without a move would have it (a wake elsewhere replaces it
    once there is room). But on a node whose NoExecute taint its deployment does not tolerate it
    stops, as Kubernetes evicts (its deployment then lacks it until there is room)."""
    observed = deployment.observed
    named = _named(deployment)  # before it is emptied: then a whole restart's name
    staying = set(_with_their_pairs([replica_id]))
    observed.restart_only = " ".join(i for i in observed.restart_only.split() if i not in staying)
    if observed.restart_only:
        save_observed(deployment, ["restart_only"])
    replica = locks.lock_replica(replica_id)  # after the deployment's row: the one lock order
    node = replica.node
    why = f"no room for replica {replica_id[:8]}'s replacement elsewhere ({err})"
    tolerated = node_labels.parse_tolerations(deployment.placement_tolerations)
    if node is not None and (evicting := node_labels.evicting(node.taints, tolerated)):
        why += (
            f"; it stops all the same: node {node.name}'s taint {node_labels.text(evicting)} is NoExecute and "
            f"{deployment.name} does not tolerate it"
        )
        _stop(deployment, replica_id, f"{named}: {why}")
    elif (
        node is not None
        and node.status == Node.Status.DRAINING
        and replica.state == Replica.State.SERVING
        and replica.lease_id is None
    ):
        replica_services.sleep_replica(
            replica_id, reason=f"{named}: {why}; it sleeps on its drained node", deployment=deployment
        )
        why += f"; it sleeps on node {node.name}, drained"
    else:
        # A pair's active member never sleeps: it serves on where it is, as in a plain drain.
        why += "; it stays where it is"
    if not observed.restart_only:
        # An empty list is a whole restart's: the move ends here, having nothing left to move.
        why = f"{named}: {why}; nothing is left to move"
        _end(deployment, why)
        return Step(Action.DONE, (replica_id,), why)
    outbox.note(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        f"{named}: {why}",
        deployment=deployment.name,
        replica=replica_id,
    )
    return Step(Action.WAIT, (replica_id,), why)


def _end(deployment: Deployment, why: str, *, outcome: Rollout = Rollout.STOPPED) -> None:
    observed = deployment.observed
    observed.restart_since, observed.restart_surge, observed.restart_only = None, "", ""
    save_observed(deployment, ["restart_since", "restart_surge", "restart_only"])
    outbox.note(
        Event.Kind.DEPLOYMENT_CHANGED,
        f"deployment {deployment.name}",
        why,
        after={"rollout": outcome},
        deployment=deployment.name,
    )
