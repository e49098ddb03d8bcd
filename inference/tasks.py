"""Tasks that run on a node agent's own queue (`node.<name>`)."""

import socket

from celery import shared_task

from scheduling.models import Node


@shared_task(name="inference.tasks.describe_node")
def describe_node(name: str) -> dict:
    """What the agent consuming this node's queue sees: proves the queue reaches the right host."""
    node = Node.objects.prefetch_related("gpus").get(name=name)
    return {
        "node": node.name,
        "hostname": socket.gethostname(),
        "gpus": [{"index": g.index, "uuid": g.uuid, "total_bytes": g.total_bytes} for g in node.gpus.all()],
    }
