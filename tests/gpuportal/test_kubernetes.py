"""deploy/kubernetes, checked without a cluster: the base and the example overlay render (with the
project's own renderer; with `kubectl kustomize` too where it is installed, which must agree), every
object is valid against the Kubernetes API schema (offline, strict: an unknown field fails), and the
manifests say what matters: each role started as the product starts it, the web's probes, one beat
with the lock scheduler, node agents on GPU nodes with their token and no database credentials."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from celery.utils.imports import symbol_by_name
from django.conf import settings
from django.http.request import validate_host

from gpuportal.celery import app as celery_app
from gpuportal.wire.control import AGENT_QUEUE
from scheduling.beat_lock import LockedDatabaseScheduler
from tests.gpuportal.test_compose import DOCKERFILE, as_argv, check_command, dockerfile_instructions, load_compose

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
BASE = KUBERNETES / "base"
EXAMPLE = KUBERNETES / "overlays" / "example"
SECRETS_TEMPLATE = KUBERNETES / "secrets.example.yaml"
# The oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate knows.
VERSIONS = ("1.29", kubernetes_validate.latest_version())

NODE_TOKENS_DIR = "/etc/gpuportal/node-tokens"
# Set in the manifests though the product's code does not read them by name: each says who does.
NOT_THE_PRODUCTS = {
    "NODE_NAME": "the agent's --node and token file, expanded by the kubelet",
    "HOME": "where the libraries keep their caches: an emptyDir on a read-only root",
    "HF_HUB_CACHE": "huggingface_hub: where `hf:` sources are found (inference.hub)",
}


def _load_renderer():
    spec = importlib.util.spec_from_file_location("gpuportal_k8s_render", KUBERNETES / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


renderer = _load_renderer()


def by_identity(objects: list[dict]) -> dict[tuple[str, str], dict]:
    found = {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}
    assert len(found) == len(objects), "two objects of one kind share a name"
    return found


BASE_OBJECTS = by_identity(renderer.render(BASE))
EXAMPLE_OBJECTS = by_identity(renderer.render(EXAMPLE))
SECRETS = by_identity(renderer.load_objects(SECRETS_TEMPLATE))


def workload(kind: str, name: str) -> dict:
    return BASE_OBJECTS[(kind, name)]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def main_container(obj: dict) -> dict:
    (container,) = pod_spec(obj)["containers"]
    return container


def workloads() -> list[dict]:
    return [obj for obj in BASE_OBJECTS.values() if obj["kind"] in renderer.WORKLOADS]


def expanded(argv: list[str], container: dict) -> list[str]:
    """The argv as the kubelet runs it: $(VAR) from the container's env; a value from the downward
    API stands for a node's name."""
    values = {}
    for var in container.get("env", []):
        values[var["name"]] = var.get("value", "gpu-node-1")
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in argv]


def env_names(container: dict) -> set[str]:
    """Every variable the container gets: its env, and every key of what its envFrom names."""
    names = {var["name"] for var in container.get("env", [])}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            names |= set(BASE_OBJECTS[("ConfigMap", source["configMapRef"]["name"])]["data"])
        if "secretRef" in source:
            names |= set(SECRETS[("Secret", source["secretRef"]["name"])]["stringData"])
    return names


# --- rendering and the API schema ---------------------------------------------------------------


def test_the_base_has_every_role_of_the_portal_and_no_secret():
    assert set(BASE_OBJECTS) == {
        ("ConfigMap", "gpuportal"),
        ("Job", "gpuportal-migrate"),
        ("Deployment", "gpuportal-web"),
        ("Service", "gpuportal-web"),
        ("PodDisruptionBudget", "gpuportal-web"),
        ("Deployment", "gpuportal-control"),
        ("Deployment", "gpuportal-agents"),
        ("Deployment", "gpuportal-beat"),
        ("DaemonSet", "gpuportal-agent"),
    }
    assert all("namespace" not in obj["metadata"] for obj in BASE_OBJECTS.values()), "the base names no namespace"
    for obj in BASE_OBJECTS.values():
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpuportal"


def test_the_example_overlay_puts_the_base_in_a_namespace_with_its_image():
    assert ("Namespace", "gpuportal") in EXAMPLE_OBJECTS
    for key, obj in EXAMPLE_OBJECTS.items():
        if key[0] != "Namespace":
            assert obj["metadata"]["namespace"] == "gpuportal", key
    images = {
        c["image"] for obj in EXAMPLE_OBJECTS.values() if obj["kind"] in renderer.WORKLOADS for c in containers(obj)
    }
    assert images == {"registry.example.org/gpuportal:0.1.0"}
    agent = EXAMPLE_OBJECTS[("DaemonSet", "gpuportal-agent")]
    assert main_container(agent)["resources"]["limits"]["nvidia.com/gpu"] == 4


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_api_schema(version):
    objects = [*BASE_OBJECTS.values(), *EXAMPLE_OBJECTS.values(), *SECRETS.values()]
    invalid = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(str(part) for part in err.path)
            invalid.append(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {err.message}")
    assert invalid == []


def test_the_schema_check_refuses_an_unknown_field_and_a_wrong_type():
    web = yaml.safe_load(yaml.safe_dump(workload("Deployment", "gpuportal-web")))
    main_container(web)["livenesProbe"] = {"httpGet": {"path": "/healthz", "port": "http"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(web, VERSIONS[-1], strict=True)
    beat = yaml.safe_load(yaml.safe_dump(workload("Deployment", "gpuportal-beat")))
    beat["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(beat, VERSIONS[-1], strict=True)


def test_the_renderer_refuses_what_it_does_not_know(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(renderer.RenderError, match="namePrefix"):
        renderer.render(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed here")
@pytest.mark.parametrize("directory", [BASE, EXAMPLE], ids=["base", "example"])
def test_kubectl_kustomize_renders_the_same_objects(directory):
    done = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    theirs = by_identity([doc for doc in yaml.safe_load_all(done.stdout) if doc])
    assert theirs == by_identity(renderer.render(directory))


# --- each role, started as the product starts it -------------------------------------------------


def test_every_container_command_names_something_that_exists():
    for obj in workloads():
        for container in containers(obj):
            check_command(expanded(container["command"], container))


def test_each_role_runs_the_command_compose_runs_it_with():
    services = load_compose()["services"]
    for role in ("migrate", "web", "control", "agents", "beat"):
        kind = "Job" if role == "migrate" else "Deployment"
        command = main_container(workload(kind, f"gpuportal-{role}"))["command"]
        assert command == as_argv(services[role]["command"]), role
    agent = main_container(workload("DaemonSet", "gpuportal-agent"))["command"]
    assert agent[:-1] == as_argv(services["agent"]["command"])[:-1], "the agent, but for its node's name"


def test_the_workers_consume_the_queues_the_code_routes_to():
    queues = {}
    for role in ("control", "agents"):
        argv = main_container(workload("Deployment", f"gpuportal-{role}"))["command"]
        queues[role] = argv[argv.index("-Q") + 1]
    assert queues == {"control": celery_app.conf.task_default_queue, "agents": AGENT_QUEUE}
    agents = main_container(workload("Deployment", "gpuportal-agents"))["command"]
    assert agents[agents.index("--pool") + 1] == "threads"


def test_every_pod_runs_the_one_image_as_its_non_root_user():
    useradd = next(args for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()) if "useradd" in args)
    uid = int(re.search(r"--uid (\d+)", useradd).group(1))
    for obj in workloads():
        spec = pod_spec(obj)
        name = obj["metadata"]["name"]
        # A named USER (the Dockerfile's) cannot be checked by runAsNonRoot: the pod names the uid.
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == uid, name
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False, name
        for container in containers(obj):
            assert container["image"] == load_compose()["services"]["web"]["image"], name
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"], name
            assert context["readOnlyRootFilesystem"] is True, name


def test_what_the_portal_writes_lands_on_a_writable_volume():
    data_dir = BASE_OBJECTS[("ConfigMap", "gpuportal")]["data"]["GPUPORTAL_DATA_DIR"]
    for obj in workloads():
        volumes = {volume["name"]: volume for volume in pod_spec(obj)["volumes"]}
        for container in containers(obj):
            mounts = {mount["mountPath"]: mount for mount in container.get("volumeMounts", [])}
            writable = {path for path, mount in mounts.items() if "emptyDir" in volumes[mount["name"]]}
            assert {"/tmp", "/home/gpuportal"} <= writable, obj["metadata"]["name"]
            if container["name"] != "wait-for-migrations":
                assert data_dir in writable, obj["metadata"]["name"]
            for var in container.get("env", []):
                if var["name"] == "PROMETHEUS_MULTIPROC_DIR":
                    assert var["value"] in writable


def test_the_web_and_the_workers_wait_for_the_migrate_job():
    assert main_container(workload("Job", "gpuportal-migrate"))["command"][2:] == ["migrate", "--noinput"]
    for role in ("web", "control", "agents", "beat"):
        (wait,) = pod_spec(workload("Deployment", f"gpuportal-{role}"))["initContainers"]
        assert wait["command"][1:] == ["manage.py", "migrate", "--check"], role
    assert "initContainers" not in pod_spec(workload("DaemonSet", "gpuportal-agent")), "agents need no database"


# --- the web ------------------------------------------------------------------------------------


def test_the_web_has_two_replicas_and_probes_on_healthz_and_readyz():
    web = workload("Deployment", "gpuportal-web")
    assert web["spec"]["replicas"] == 2
    container = main_container(web)
    argv = container["command"]
    (port,) = container["ports"]
    assert port["containerPort"] == int(argv[argv.index("--port") + 1])
    allowed = BASE_OBJECTS[("ConfigMap", "gpuportal")]["data"]["GPUPORTAL_ALLOWED_HOSTS"].split(",")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path and get["port"] == port["name"], probe
        # The kubelet sends the pod's IP as Host, which Django refuses with a 400 unless allowed.
        (host,) = [header["value"] for header in get["httpHeaders"] if header["name"] == "Host"]
        assert validate_host(host, allowed), f"{probe}: Host {host} is not in GPUPORTAL_ALLOWED_HOSTS"


def test_the_service_and_the_disruption_budget_select_the_web_pods():
    web = workload("Deployment", "gpuportal-web")
    labels = web["spec"]["template"]["metadata"]["labels"]
    service = BASE_OBJECTS[("Service", "gpuportal-web")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == main_container(web)["ports"][0]["name"]
    budget = BASE_OBJECTS[("PodDisruptionBudget", "gpuportal-web")]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 0 < budget["spec"]["minAvailable"] < web["spec"]["replicas"]
    for obj in workloads():
        if obj is not web:
            other = obj["spec"]["template"]["metadata"]["labels"]
            assert not service["spec"]["selector"].items() <= other.items(), obj["metadata"]["name"]


# --- beat ---------------------------------------------------------------------------------------


def test_beat_is_one_replica_stopped_before_the_next_and_sends_only_under_its_lock():
    beat = workload("Deployment", "gpuportal-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    argv = main_container(beat)["command"]
    scheduler = argv[argv.index("--scheduler") + 1]
    assert scheduler == settings.CELERY_BEAT_SCHEDULER
    assert symbol_by_name(scheduler) is LockedDatabaseScheduler


# --- the node agent -----------------------------------------------------------------------------


def test_the_node_agent_runs_on_every_gpu_node_with_its_gpus_and_shared_memory():
    agent = workload("DaemonSet", "gpuportal-agent")
    spec = pod_spec(agent)
    assert spec["hostPID"] is False and spec["hostIPC"] is False
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in terms[0]["matchExpressions"]
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
    container = main_container(agent)
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (shm,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


def test_the_node_agent_is_named_after_its_node_and_reads_its_own_token():
    agent = workload("DaemonSet", "gpuportal-agent")
    container = main_container(agent)
    env = {var["name"]: var for var in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    argv = container["command"]
    assert argv[argv.index("--node") + 1] == "$(NODE_NAME)"
    assert env["GPUPORTAL_NODE_TOKEN_FILE"]["value"] == f"{NODE_TOKENS_DIR}/$(NODE_NAME)"
    # A $(VAR) expands only when VAR comes earlier in the list.
    names = [var["name"] for var in container["env"]]
    assert names.index("NODE_NAME") < names.index("GPUPORTAL_NODE_TOKEN_FILE")
    (mount,) = [mount for mount in container["volumeMounts"] if mount["mountPath"] == NODE_TOKENS_DIR]
    assert mount["readOnly"] is True
    (volume,) = [volume for volume in pod_spec(agent)["volumes"] if volume["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "gpuportal-node-tokens"
    assert volume["secret"]["defaultMode"] == 0o440


def test_the_node_agent_gets_redis_and_no_database_credentials():
    agent = workload("DaemonSet", "gpuportal-agent")
    container = main_container(agent)
    names = env_names(container)
    assert "REDIS_URL" in names
    assert "DATABASE_URL" not in names
    # Nor a Secret that holds it: a node's kubelet may read every key of a Secret its pods name.
    named = {source["secretRef"]["name"] for source in container.get("envFrom", []) if "secretRef" in source}
    named |= {
        var["valueFrom"]["secretKeyRef"]["name"]
        for var in container["env"]
        if "secretKeyRef" in var.get("valueFrom", {})
    }
    named |= {volume["secret"]["secretName"] for volume in pod_spec(agent)["volumes"] if "secret" in volume}
    assert all("DATABASE_URL" not in SECRETS[("Secret", name)]["stringData"] for name in named)
    assert all("GPUPORTAL_SECRET_KEY" not in SECRETS[("Secret", name)]["stringData"] for name in named)


# --- settings and secrets -----------------------------------------------------------------------


def test_every_secret_a_pod_reads_is_in_the_template_with_placeholders_only():
    for obj in workloads():
        for container in containers(obj):
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    assert ("Secret", source["secretRef"]["name"]) in SECRETS
        for volume in pod_spec(obj).get("volumes", []):
            if "secret" in volume:
                assert ("Secret", volume["secret"]["secretName"]) in SECRETS
    for secret in SECRETS.values():
        assert all("REPLACE-ME" in value for value in secret["stringData"].values()), secret["metadata"]["name"]


def test_every_setting_the_manifests_set_is_one_the_product_reads():
    code = "\n".join(
        path.read_text()
        for package in ("gpuportal", "scheduling", "inference")
        for path in (ROOT / package).rglob("*.py")
    )
    names = set()
    for obj in workloads():
        for container in containers(obj):
            names |= env_names(container)
    unread = sorted(name for name in names if name not in NOT_THE_PRODUCTS and f'"{name}"' not in code)
    assert unread == [], "set in deploy/kubernetes, read by nothing in the product"
