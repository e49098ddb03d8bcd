"""Deployments in the books without replica processes (their reports made by hand), and the
states of a deployment's replicas as tests wait on them."""

from __future__ import annotations

from gpuportal.wire.memory import MiB
from scheduling.models import GPU, Occupant, Replica
from scheduling.services import reports
from scheduling.services.deployments import DeploymentSpec, ModelFacts, create

START, TO_CACHE, FROM_CACHE, STOP = (
    "inference.tasks.start_replica",
    "inference.tasks.replica_to_cache",
    "inference.tasks.replica_from_cache",
    "inference.tasks.stop_replica",
)


def body(name: str, model_dir, **overrides) -> dict:
    data = {
        "name": name,
        "model": {"source": str(model_dir), "loader": "transformers", "dtype": "float32"},
        "replicas": 1,
        "memory": {"override_bytes": 300 * MiB, "max_tokens": 256},
    }
    data.update(overrides)
    return data


def serve(replica_id: str, **extra) -> None:
    reports.report(replica_id, {"event": "serving", "pid": 4242, "weights_bytes": 10 * MiB, **extra})


def asleep(replica_id: str) -> None:
    """What the replica process reports once its weights are in CPU RAM (a virtual GPU keeps nothing)."""
    reports.report(replica_id, {"event": "sleeping", "residual_bytes_by_id": {"0": 0}})


def reserved(replica_id: str) -> int:
    return sum(Occupant.objects.filter(replica_id=replica_id).values_list("reserved_bytes", flat=True))


def invariant_holds() -> bool:
    return all(
        g.available_bytes == g.total_bytes - sum(o.reserved_bytes for o in g.occupants.all()) >= 0
        for g in GPU.objects.prefetch_related("occupants")
    )


LOAD_TIMEOUT = 180  # each replica process imports torch and transformers: seconds on 2 cores


def states(deployment: str) -> dict[str, str]:
    return dict(Replica.objects.filter(deployment__name=deployment).values_list("id", "state"))


def all_in(deployment: str, state: str, count: int):
    def check():
        found = states(deployment)
        failed = {k: v for k, v in found.items() if v == "failed"}
        assert not failed, Replica.objects.filter(pk__in=failed).values_list("failure_reason", flat=True)
        return len(found) == count and set(found.values()) == {state}

    return check


def deploy(name: str, replicas: int = 1, **spec) -> str:
    """A deployment placed by the services, its first replica serving; returns that replica's id."""
    facts = ModelFacts(weight_bytes=10 * MiB, estimate_bytes=300 * MiB)
    deployment = create(
        DeploymentSpec(name=name, source="/srv/models/tiny", replicas=replicas, override_bytes=300 * MiB, **spec),
        facts=facts,
    )
    replica_id = deployment.replicas.order_by("created_at").first().id
    serve(replica_id)
    return replica_id


def deploy_serving(api, model_dir, name: str = "tiny-a", **overrides) -> list[str]:
    """Deploy through the API and report each placed replica serving (no process): its ids."""
    assert api("post", "/api/deployments/", body(name, model_dir, **overrides)).status_code == 201
    ids = list(Replica.objects.filter(deployment__name=name).order_by("pk").values_list("id", flat=True))
    for replica_id in ids:
        serve(replica_id)
    return ids
