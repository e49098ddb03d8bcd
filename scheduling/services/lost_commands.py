"""Commands to a node agent lost after the decision that sent them committed (the broker blinked
as it was sent: there is no outbox), found by the node's heartbeat and sent again.

A beat names the replica processes the agent runs and the state each last said it is in
(gpuportal.wire.control.ControlPlane.heartbeat). A replica whose books still wait for a command
past its grace, while the beat shows that the command never arrived, gets it again:

- pending past GPUPORTAL_START_GRACE_S, no process: START again;
- waking past GPUPORTAL_WAKE_GRACE_S, its process asleep, or awake (its `woken` report was lost),
  or none: WAKE again;
- draining past its deployment's drain timeout + GPUPORTAL_SLEEP_GRACE_S, its process serving, or
  asleep (its `sleeping` report was lost), or none: SLEEP again;
- stopping past its drain timeout + GPUPORTAL_STOP_GRACE_S, its process still run: STOP again;
  no process: its `stopped` report was lost, and is applied as the agent would have sent it;
- serving, its host arena granted GPUPORTAL_ARENA_GRACE_S ago, its process serving and keeping
  none: the grant (ARENA keep) again; serving with no arena in the books GPUPORTAL_ARENA_GRACE_S
  after its last change, its process keeping one: the drop (ARENA drop) again, since host memory
  held unaccounted is the unsafe side;
- loading, serving, asleep in its process or standing by past GPUPORTAL_END_GRACE_S, no process:
  its process ended and its `failed` report was lost; applied as the agent would have sent it.
  Without this the books would count a replica serving on memory nobody holds, for good.

A process in the middle of the command (waking, draining, or a state not said yet) is left
alone. Where there is no process, the command sent again makes the agent say so (a failed
report: no process for this replica), and the books catch up. A failover pair member never
sleeps: one that drains is stepping down by a STOP (failover.switchover), and is left to its pair.

A claim (a compare-and-swap on updated_at) lets one of two beats that saw the replica resend, and
only once per grace; an Event says why. A second copy of a command is harmless: the agent carries
a start, a wake or a sleep out only while the books still wait for it, a replica process answers a
sleep while asleep, or a wake to where it serves, with the report it had sent, and a stop of a
replica the agent no longer runs is answered `stopped`, which the books apply as nothing new.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial

from django.conf import settings
from django.db import transaction

from gpuportal.wire import memory
from scheduling.core import effects
from scheduling.core.effects import ToNode
from scheduling.models import Event, Occupant, Replica
from scheduling.services import outbox, reports

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Overdue:
    id: str
    node: str
    deployment: str
    state: str
    # updated_at as read: the claim's compare-and-swap is on it.
    seen: datetime
    # How long it has been waiting, in seconds, and how long it may (the grace, and the drain).
    waited_s: float
    allowed_s: float
    paired: bool


@dataclass(frozen=True)
class _Row:
    """A replica of the node as one look read it: what every kind of lost command is judged on."""

    id: str
    deployment: str
    updated_at: datetime
    drain_timeout_s: float | None
    lease_id: int | None
    state: str
    arena_kept_bytes: int


def resend(
    name: str,
    running: Collection[str],
    processes: Mapping[str, str] | None,
    now: datetime,
    *,
    arenas: Mapping[str, int] | None = None,
) -> dict[str, list[str]]:
    """Every lost command of node `name`'s replicas, sent again (or, for a lost `stopped` report,
    applied): {command: replica ids}. Without `processes` (an agent that does not send them),
    only what `running` shows: lost starts and stops; without `arenas`, no lost arena command."""
    running = set(running)
    # One read for every kind: a node serving anything has replicas past the shortest grace at
    # every beat, and each kind reading its own cost that beat six more statements. The kinds'
    # states do not overlap (the end's and the arena's serving replicas: without a process, and
    # with one), and a claim's compare-and-swap refuses a row that moved since it was read.
    rows = _rows(name, _WAITING, now - timedelta(seconds=_shortest_grace_s()))
    kinds: dict[str, Callable[[], list[str]]] = {
        "start": partial(resend_lost_starts, name, running, now, rows=rows),
        "stop": partial(resend_lost_stops, name, running, now, rows=rows),
        "end": partial(apply_lost_ends, name, running, now, rows=rows),
    }
    if processes is not None:
        kinds["wake"] = partial(resend_lost_wakes, name, running, processes, now, rows=rows)
        kinds["sleep"] = partial(resend_lost_sleeps, name, running, processes, now, rows=rows)
        if arenas is not None:
            kinds["arena"] = partial(resend_lost_arenas, name, running, processes, arenas, now, rows=rows)
    if not rows:
        return {kind: [] for kind in kinds}
    found: dict[str, list[str]] = {}
    for kind, look in kinds.items():
        try:
            found[kind] = look()
        except Exception:
            # The beat is recorded already, and its answer (what to stop) must still reach the agent:
            # the next beat looks again.
            log.exception("could not look for lost %s commands of node %s's replicas", kind, name)
            found[kind] = []
    return found


def resend_lost_starts(
    name: str, running: Collection[str], now: datetime, *, rows: Sequence[_Row] | None = None
) -> list[str]:
    """Start commands that never reached the node's agent, sent again: a replica placed here long
    enough ago (GPUPORTAL_START_GRACE_S) that is still pending, and whose process the agent does not
    run, lost its command after the placement committed. Sending it twice is harmless: the agent
    refuses to start a replica it runs."""
    grace = settings.GPUPORTAL_START_GRACE_S
    resent = []
    for replica in _overdue(name, Replica.State.PENDING, grace, now, drain=False, rows=rows):
        if replica.id in running:
            continue
        reason = (
            f"still pending {grace:g} s after its placement and not run by node {name}'s agent: its start "
            "command was lost, sent again"
        )
        if _claim(replica, now, reason, "start", None, effects.start(name, replica.id, [])):
            resent.append(replica.id)
    return resent


def resend_lost_wakes(
    name: str,
    running: Collection[str],
    processes: Mapping[str, str],
    now: datetime,
    *,
    rows: Sequence[_Row] | None = None,
) -> list[str]:
    """Wake commands that never reached the node's agent (its process still sleeps), or whose
    `woken` report never came back (it serves): sent again past GPUPORTAL_WAKE_GRACE_S, waiting, as
    the first did, for the replicas still draining on its GPUs to let go of them."""
    grace = settings.GPUPORTAL_WAKE_GRACE_S
    why = {
        "sleeping": "its process still sleeps: its wake command was lost, sent again",
        "serving": "its process serves: its woken report was lost, the wake sent again for it to say so again",
        None: "it runs no process for it: the wake is sent again for the agent to report it gone",
    }
    resent = []
    for replica in _overdue(name, Replica.State.WAKING, grace, now, drain=False, rows=rows):
        process = processes.get(replica.id) if replica.id in running else None
        if replica.paired or process not in why:
            continue  # waking now, or a state it has not said yet
        reason = f"still waking {grace:g} s after its promotion, and node {name}'s agent says {why[process]}"
        order = effects.wake(name, replica.id, _draining_beside(replica.id))
        if _claim(replica, now, reason, "wake", process, order):
            resent.append(replica.id)
    return resent


def resend_lost_sleeps(
    name: str,
    running: Collection[str],
    processes: Mapping[str, str],
    now: datetime,
    *,
    rows: Sequence[_Row] | None = None,
) -> list[str]:
    """Sleep commands that never reached the node's agent (its process still serves), or whose
    `sleeping` report never came back (it sleeps): sent again past the deployment's drain timeout
    and GPUPORTAL_SLEEP_GRACE_S."""
    grace = settings.GPUPORTAL_SLEEP_GRACE_S
    why = {
        "serving": "its process still serves: its sleep command was lost, sent again",
        "sleeping": "its process sleeps: its sleeping report was lost, the sleep sent again for it to say so again",
        None: "it runs no process for it: the sleep is sent again for the agent to report it gone",
    }
    resent = []
    for replica in _overdue(name, Replica.State.DRAINING, grace, now, drain=True, rows=rows):
        process = processes.get(replica.id) if replica.id in running else None
        if replica.paired or process not in why:
            continue  # draining now, or a state it has not said yet; a pair member steps down by a stop
        reason = (
            f"still draining {replica.allowed_s:g} s (its drain timeout and {grace:g} s) after it was sent to "
            f"sleep, and node {name}'s agent says {why[process]}"
        )
        if _claim(replica, now, reason, "sleep", process, effects.sleep(name, replica.id)):
            resent.append(replica.id)
    return resent


def resend_lost_stops(
    name: str, running: Collection[str], now: datetime, *, rows: Sequence[_Row] | None = None
) -> list[str]:
    """Stop commands that never reached the node's agent (it still runs the process), sent again
    past the deployment's drain timeout and GPUPORTAL_STOP_GRACE_S; and `stopped` reports that never
    came back (it runs no process for the replica), applied as the agent would have reported them:
    the reservation goes back through the one path a report takes (scheduling.services.reports)."""
    grace = settings.GPUPORTAL_STOP_GRACE_S
    found = []
    for replica in _overdue(name, Replica.State.STOPPING, grace, now, drain=True, rows=rows):
        still = f"still stopping {replica.allowed_s:g} s (its drain timeout and {grace:g} s) after it was stopped"
        if replica.id in running:
            reason = f"{still}, and node {name}'s agent still runs its process: its stop command was lost, sent again"
            # A pair member stopping (not stepping down, which drains) stops with its whole pair.
            order = effects.stop(name, replica.id, close_pair=replica.paired)
            if _claim(replica, now, reason, "stop", "running", order):
                found.append(replica.id)
            continue
        reason = (
            f"{still}, and node {name}'s agent runs no process for it: the process is gone and its stopped report "
            "was lost, applied now"
        )
        if _claim(replica, now, reason, "stopped report", None, None):
            # After the claim's commit, as the agent's report would come: in a transaction of its own.
            reports.report(replica.id, {"event": "stopped", "reason": reason})
            found.append(replica.id)
    return found


# The states only the replica's process moves it out of: it reports each change itself, its end too.
_OWN_STATES = (Replica.State.LOADING, Replica.State.SERVING, Replica.State.SLEEPING, Replica.State.STANDBY)


def apply_lost_ends(
    name: str, running: Collection[str], now: datetime, *, rows: Sequence[_Row] | None = None
) -> list[str]:
    """`failed` reports that never came back: a replica in a state only its process moves it out
    of, unchanged past GPUPORTAL_END_GRACE_S, whose process the node's agent does not run. The
    process ended (killed, crashed) and the agent's report of it was lost (it timed out, the
    broker blinked); applied as the agent would have reported it, through the one path a report
    takes, so the reservation goes back and the reconcile replaces it."""
    grace = settings.GPUPORTAL_END_GRACE_S
    found = []
    for replica in _overdue(name, _OWN_STATES, grace, now, drain=False, rows=rows):
        if replica.id in running:
            continue
        reason = (
            f"{replica.state} {replica.waited_s:.0f} s with no word from its process, and node {name}'s agent runs "
            "no process for it: the process ended and its failed report was lost, applied now"
        )
        if _claim(replica, now, reason, "failed report", None, None):
            # After the claim's commit, as the agent's report would come: in a transaction of its own.
            reports.report(replica.id, {"event": "failed", "kind": "crash", "reason": reason})
            found.append(replica.id)
    return found


def resend_lost_arenas(
    name: str,
    running: Collection[str],
    processes: Mapping[str, str],
    arenas: Mapping[str, int],
    now: datetime,
    *,
    rows: Sequence[_Row] | None = None,
) -> list[str]:
    """Arena commands (scheduling.services.host_cache) that never reached a serving replica, sent
    again past GPUPORTAL_ARENA_GRACE_S (preparing an arena of a large model's weights takes
    seconds): a grant the books count while the process keeps no arena (the host cache counts
    room nobody uses, and the next sleep is not a plain copy), and a drop the books made while
    the process still keeps one (memory the host cache does not count: the unsafe side). A
    process that is not serving (asleep, waking, draining) is left alone: a sleep consumes the
    arena and a wake keeps the one it read."""
    grace = settings.GPUPORTAL_ARENA_GRACE_S
    cutoff = now - timedelta(seconds=grace)
    serving = (Replica.State.SERVING,)
    resent = []
    for row in _rows(name, serving, cutoff) if rows is None else rows:
        if row.state not in serving or row.updated_at >= cutoff:
            continue
        replica_id, booked = row.id, row.arena_kept_bytes
        if replica_id not in running or processes.get(replica_id) != "serving":
            continue  # no process (the start or stop checks see to it), or one between states
        kept = arenas.get(replica_id)
        if kept is None or (booked > 0) == (kept > 0):
            continue  # not said yet (an adopted process before its first pong), or as the books say
        waited = (now - row.updated_at).total_seconds()
        paired = row.lease_id is not None
        replica = _Overdue(replica_id, name, row.deployment, row.state, row.updated_at, waited, grace, paired)
        keep = booked > 0
        reason = (
            f"granted a {memory.human_bytes(booked)} host arena {waited:.0f} s ago, and node {name}'s agent says "
            "its process keeps none: the grant was lost, sent again"
            if keep
            else f"its host arena was taken back, and node {name}'s agent says its process still keeps "
            f"{memory.human_bytes(kept)} that the host cache does not count: the drop was lost, sent again"
        )
        order = effects.keep_arena(name, replica_id, keep=keep)
        if _claim(replica, now, reason, "arena keep" if keep else "arena drop", "serving", order):
            resent.append(replica_id)
    return resent


# -- helpers ---------------------------------------------------------------------------------------

# The states a lost command or report leaves a replica waiting in (serving: an arena grant or
# drop, or its end).
_WAITING = tuple(
    dict.fromkeys(
        (Replica.State.PENDING, Replica.State.WAKING, Replica.State.DRAINING, Replica.State.STOPPING, *_OWN_STATES)
    )
)


def _shortest_grace_s() -> float:
    return min(
        settings.GPUPORTAL_START_GRACE_S,
        settings.GPUPORTAL_WAKE_GRACE_S,
        settings.GPUPORTAL_SLEEP_GRACE_S,
        settings.GPUPORTAL_STOP_GRACE_S,
        settings.GPUPORTAL_ARENA_GRACE_S,
        settings.GPUPORTAL_END_GRACE_S,
    )


# _Row's fields, in its order.
_ROW_COLUMNS = (
    "pk",
    "deployment__name",
    "updated_at",
    "deployment__drain_timeout_s",
    "lease_id",
    "state",
    "arena_kept_bytes",
)


def _rows(name: str, states: Sequence[str], older_than: datetime) -> list[_Row]:
    """The node's replicas in `states` unchanged since before `older_than`, oldest first (the
    order each kind resends in)."""
    return [
        _Row(*row)
        for row in Replica.objects.filter(node__name=name, state__in=states, updated_at__lt=older_than)
        .order_by("updated_at", "pk")
        .values_list(*_ROW_COLUMNS)
    ]


def _overdue(
    name: str,
    state: str | tuple[str, ...],
    grace_s: float,
    now: datetime,
    *,
    drain: bool,
    rows: Sequence[_Row] | None = None,
) -> list[_Overdue]:
    """The node's replicas in `state` (or any of several) unchanged for longer than the grace (and,
    with `drain`, their deployment's drain timeout), oldest first. `rows`: the node's replicas as
    the beat read them for every kind (`resend`), a superset of these."""
    states = (state,) if isinstance(state, str) else state
    cutoff = now - timedelta(seconds=grace_s)
    found = []
    for row in _rows(name, states, cutoff) if rows is None else rows:
        if row.state not in states or row.updated_at >= cutoff:
            continue
        allowed = grace_s + (float(row.drain_timeout_s or 0.0) if drain else 0.0)
        waited = (now - row.updated_at).total_seconds()
        if waited > allowed:
            paired = row.lease_id is not None
            found.append(_Overdue(row.id, name, row.deployment, row.state, row.updated_at, waited, allowed, paired))
    return found


def _claim(
    replica: _Overdue, now: datetime, reason: str, command: str, process: str | None, order: ToNode | None
) -> bool:
    """Claim the replica (one of two beats that saw it wins, and the next resend waits a grace),
    send its `order` once the claim has committed, and say why in an Event. False: claimed by
    another beat, or it moved on meanwhile."""
    with transaction.atomic():
        # A compare-and-swap on updated_at: the row as this beat saw it, still in that state.
        claimed = Replica.objects.filter(pk=replica.id, state=replica.state, updated_at=replica.seen)
        if not claimed.update(updated_at=now):
            return False
        if order is not None:
            outbox.want(order)
        outbox.note(
            Event.Kind.REPLICA_STATE,
            f"replica {replica.id[:8]}",
            reason,
            after={"resent": command, "process": process or "none", "waited_s": round(replica.waited_s, 1)},
            node=replica.node,
            deployment=replica.deployment,
            replica=replica.id,
        )
    return True


def _draining_beside(replica_id: str) -> list[str]:
    """Replicas still draining on the GPUs the waker holds: a wake sent again waits for them to let
    go, as the first did for the victims evicted for it (the agent waits only for those that still
    serve on its node, and no longer than GPUPORTAL_EVICTION_WAIT_S)."""
    gpus = Occupant.objects.filter(replica_id=replica_id).values("gpu_id")
    draining = Replica.objects.filter(state=Replica.State.DRAINING, occupancies__gpu_id__in=gpus).exclude(pk=replica_id)
    return sorted(set(draining.values_list("pk", flat=True)))
