"""Control-plane Celery tasks. Tasks only call services (they hold no logic of their own)."""

from celery import shared_task

from scheduling.services import nodes, sleep


@shared_task(name="scheduling.tasks.expire_heartbeats", ignore_result=True)
def expire_heartbeats() -> list[str]:
    return nodes.expire_heartbeats()


@shared_task(name="scheduling.tasks.sleep_idle", ignore_result=True)
def sleep_idle() -> list[str]:
    return sleep.sweep_idle()
