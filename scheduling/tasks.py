"""Control-plane Celery tasks. Tasks only call services (they hold no logic of their own)."""

import logging

from celery import shared_task

from scheduling.services import (
    autoscaling,
    capacity,
    cleanup,
    deep_sleep,
    deployments,
    host_cache,
    node_gateway,
    node_marks,
    node_users,
    nodes,
    preemption,
    rollouts,
    sleep,
    traffic,
)
from scheduling.services.errors import ServiceError

log = logging.getLogger(__name__)


# On the `agents` queue (gpuportal.wire.control). Acknowledged on receipt: a call whose worker died
# is not applied again an hour later, when its caller has long given up on it.
@shared_task(name="scheduling.tasks.agent_call", ignore_result=True, acks_late=False)
def agent_call(payload: dict) -> str:
    """One call of a node agent: a report, a heartbeat, a registration."""
    return node_gateway.answer(payload)


@shared_task(name="scheduling.tasks.expire_heartbeats", ignore_result=True)
def expire_heartbeats() -> list[str]:
    return nodes.expire_heartbeats()


@shared_task(name="scheduling.tasks.sleep_idle", ignore_result=True)
def sleep_idle() -> list[str]:
    """Idle replicas to sleep, and long sleepers to deep sleep: the ids told."""
    return sleep.sweep_idle() + deep_sleep.sweep_deep()


@shared_task(name="scheduling.tasks.autoscale", ignore_result=True)
def autoscale() -> dict[str, int]:
    """Each autoscaled deployment to the replicas its requests in flight want: those changed."""
    return autoscaling.sweep()


@shared_task(name="scheduling.tasks.advance_restarts", ignore_result=True)
def advance_restarts() -> dict[str, str]:
    """One step of each rolling restart under way: by deployment, the step taken."""
    return rollouts.advance_all()


@shared_task(name="scheduling.tasks.keep_node_users", ignore_result=True)
def keep_node_users() -> dict[str, list[str]]:
    """Each node's Redis user the control plane keeps to the deployments placed on its node: by
    node, the deployments whose queues it no longer reaches."""
    return node_users.sweep()


@shared_task(name="scheduling.tasks.deepen_sleepers", ignore_result=True)
def deepen_sleepers(replica_ids: list[str], reason: str) -> list[str]:
    """Sleepers a waiting wake needs the GPU memory of (scheduling.services.preemption): told to
    sleep deeply, each in its own transaction."""
    return deep_sleep.deepen_all(replica_ids, reason=reason)


@shared_task(name="scheduling.tasks.collect_ended_replicas", ignore_result=True)
def collect_ended_replicas() -> list[str]:
    return cleanup.collect_ended_replicas()


@shared_task(name="scheduling.tasks.replace_failed", ignore_result=True)
def replace_failed(name: str) -> list[str]:
    """A failed load's backoff is over: place what the deployment lacks (crash-loop backoff)."""
    return deployments.replace_failed(name)


@shared_task(name="scheduling.tasks.reconcile", ignore_result=True)
def reconcile(reason: str) -> dict[str, list[str]]:
    """Every deployment back to its replicas (after a node went offline, stopped, or registered),
    and what a node's NoExecute taints do not let run there moved off."""
    placed = deployments.reconcile_all(f"reconciled: {reason}")
    node_marks.evict_untolerated()
    return placed


@shared_task(name="scheduling.tasks.trim_host_cache", ignore_result=True)
def trim_host_cache(node: str) -> dict[str, list[str]]:
    """The node's host cache within its budget, then its spare room lent as kept arenas:
    the ids parked and granted."""
    return host_cache.balance(node)


@shared_task(name="scheduling.tasks.preempt", ignore_result=True)
def preempt(intent_ids: list[int]) -> str:
    """The fair wake's wait, victim choice and placement (runs for up to max_wait + a drain)."""
    outcome = preemption.run_preemption(intent_ids)
    return f"{outcome.status}: {outcome.reason}"


@shared_task(name="scheduling.tasks.wake", ignore_result=True)
def wake(name: str, reason: str) -> list[str]:
    """A wake that found another wake holding the GPU's lock, asked again."""
    try:
        return sleep.wake_again(name, reason=reason)
    except ServiceError as err:
        # Deleted meanwhile, or it cannot fit (its waiting requests were told): nothing to retry.
        log.warning("retried wake of %s: %s", name, err)
        return []


@shared_task(name="scheduling.tasks.record_requests", ignore_result=True)
def record_requests() -> dict[str, int]:
    """The records of ended requests from Redis into PostgreSQL (the capacity planner's traffic)."""
    return traffic.record_requests()


# Acknowledged on receipt: a plan is minutes of simulation; one whose worker died stays `running`
# and is asked for again, rather than redelivered to a worker that may die of it the same way.
@shared_task(name="scheduling.tasks.plan_capacity", ignore_result=True, acks_late=False)
def plan_capacity(plan_id: int) -> str:
    """A capacity plan asked for through the API (minutes of simulation for a long trace)."""
    return capacity.run(plan_id)
