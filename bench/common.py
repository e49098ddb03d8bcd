"""Set-up shared by the benchmarks: a fresh database (embedded unless DATABASE_URL is set) and
a cluster of virtual GPUs registered the way agents register them."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def setup_database(name: str) -> object | None:
    """Point Django at a fresh database `name`; returns the embedded server to stop, if any."""
    import psycopg

    from gpuportal.stack import EmbeddedPostgres

    server = None
    url = os.environ.get("DATABASE_URL")
    if not url:
        pgdata = Path(tempfile.mkdtemp(prefix="gpuportal-bench-")) / "pg" / "data"
        server = EmbeddedPostgres(pgdata=pgdata, durable=False)
        url = server.start()
    base, _, _ = url.rpartition("/")
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    os.environ["DATABASE_URL"] = f"{base}/{name}"
    # Not contacted by the benchmarks that set up this way: what their services send goes no further
    # than `effects_kept`.
    os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/0")
    os.environ["GPUPORTAL_CONN_MAX_AGE"] = "600"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuportal.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return server


@contextlib.contextmanager
def effects_kept() -> Iterator[list[str]]:
    """What the services send once a call commits (Celery tasks to node agents and the control
    queue, the Redis call that ends a deleted deployment's waiting requests) is recorded here,
    not sent: nothing leaves the process. The commands are still built from the committed rows,
    as they would be before sending."""
    from gpuportal.celery import app
    from scheduling.services import queueing

    sent: list[str] = []
    saved = app.send_task, queueing.fail_waiting

    def fail_waiting(name: str, *args: object, **kwargs: object) -> list[str]:
        sent.append(f"fail_waiting {name}")
        return []

    app.send_task = lambda name, *args, **kwargs: sent.append(name)
    queueing.fail_waiting = fail_waiting
    try:
        yield sent
    finally:
        app.send_task, queueing.fail_waiting = saved


def register_cluster(nodes: int, gpus_per_node: int, gpu_size: str) -> list[int]:
    from inference.devices import virtual_gpus
    from scheduling.models import GPU
    from scheduling.services.nodes import register_node

    # A registration asks the control worker to reconcile (a Celery task): kept here, so that no
    # broker need be running (a lent GPU machine has no Redis).
    with effects_kept():
        for n in range(nodes):
            name = f"node{n:03d}"
            register_node(name, virtual_gpus(name, f"{gpus_per_node}x{gpu_size}"), virtual=True)
    return list(GPU.objects.order_by("pk").values_list("pk", flat=True))


def stop(server: object | None) -> None:
    if server is not None:
        from django.db import connections

        connections.close_all()
        server.stop()
