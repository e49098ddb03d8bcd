"""A node's templates' service (`python -m inference.forkserver --listen`): agents pointed at it
(GPUPORTAL_REPLICA_TEMPLATE_SOCKET) fork their replicas from templates it forks, already
imported. tests/inference/test_serving.py runs real agents on it, and one that falls back to a
template of its own when it does not answer."""

from __future__ import annotations

import os

import psutil
import pytest

from inference.forkserver import ForkServer
from tests.support.processes import wait_until

pytestmark = pytest.mark.slow


def test_a_template_of_the_service_forks_replicas_on_the_agents_pipes_and_ends_with_the_connection(
    template_service, tmp_path
):
    before = template_service.log_size()
    server = ForkServer.connect(str(template_service.address))
    assert server.ready(60) and server.alive
    # The service says which template it forked once it has forked it, perhaps after the template spoke.
    (template,) = wait_until(lambda: template_service.templates_since(before), 30, "the service to name the template")

    # The replica program's help goes to its stdout: our pipe, as a replica's events do.
    replica = server.spawn(["--help"], dict(os.environ), tmp_path / "replica.log", tie=True, name="probe")
    assert replica is not None
    assert b"usage:" in replica.stdout.read()
    assert replica.wait(30) == 0
    assert psutil.Process(template).parent().cmdline()[-2] == "--listen"

    server.close()

    psutil.Process(template).wait(30)  # its agent's end closed: it ends
    assert not server.alive
