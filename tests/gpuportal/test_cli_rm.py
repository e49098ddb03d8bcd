"""`gpuportal rm NAME...`: deployments deleted in turn, as `kubectl delete` and `ollama rm` take
several; one the portal refuses is said, and the others are still deleted."""

from __future__ import annotations

import pytest

from scheduling.models import Deployment
from scheduling.services import deployments


@pytest.mark.django_db(transaction=True)
def test_rm_deletes_each_deployment_named_and_says_which_it_could_not(cluster, live_server, capsys, tiny_model_dir):
    from scheduling.services.deployments import DeploymentSpec, ModelFacts
    from tests.support.cli import staff_cli

    for name in ("a", "b", "c"):
        deployments.create(
            DeploymentSpec(name=name, source=str(tiny_model_dir), override_bytes=300 * 1024**2),
            facts=ModelFacts(weight_bytes=2**20, estimate_bytes=300 * 1024**2),
        )
    rm = staff_cli(live_server, capsys, "rm")

    assert rm("a", "gone", "b", "a") == (
        1,
        "deleted a: its replicas stop and their memory is released\n"
        "deleted b: its replicas stop and their memory is released",
        "error: no deployment named 'gone' (deployed: b, c)",
    )
    assert list(Deployment.objects.values_list("name", flat=True)) == ["c"]
    assert rm("c") == (0, "deleted c: its replicas stop and their memory is released", "")
    assert not Deployment.objects.exists()
