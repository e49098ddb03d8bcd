"""Serving end to end on virtual GPUs: a real agent, real replica processes generating text with a
tiny model, requests through the REST API; replicas killed or stopped while they hold requests."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from rest_framework.test import APIClient

from inference.management.commands.make_tiny_model import write_tiny_model
from scheduling.models import Replica
from scheduling.services import requests as request_services
from tests.support.processes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MiB = 1024**2
LOAD_TIMEOUT = 180


def serving(count: int):
    def check():
        states = list(Replica.objects.filter(deployment__name="tiny").values_list("state", flat=True))
        assert "failed" not in states, Replica.objects.values_list("failure_reason", flat=True)
        return states.count("serving") == count

    return check


@pytest.fixture
def deployed(start_agent, staff, tmp_path, request):
    """Two replicas of the tiny model serving on a real agent; with `own template` (indirect
    parametrization), an agent pointed at a templates' service that is not there, which then
    starts a template of its own, as every agent does by default."""
    if getattr(request, "param", None) == "own template":
        start_agent("e2e", "2x4GiB", GPUPORTAL_REPLICA_TEMPLATE_SOCKET=str(tmp_path / "no-service.sock"))
    else:
        start_agent("e2e", "2x4GiB")
    request_services.queue.cache_clear()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=3).path
    body = {
        "name": "tiny",
        "model": {"source": str(model)},
        "replicas": 2,
        "memory": {"override_bytes": 200 * MiB, "max_tokens": 256},
    }
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    wait_until(serving(2), LOAD_TIMEOUT, "two replicas to serve")
    return staff


def infer_generates_text_with_usage_and_polling_sees_the_same(deployed: APIClient) -> None:
    response = deployed.post(
        "/api/deployments/tiny/infer/", {"input": "Hello", "params": {"max_tokens": 8}, "timeout_s": 60}, format="json"
    )

    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == "done" and isinstance(body["output"]["text"], str)
    assert body["output"]["usage"]["completion_tokens"] <= 8 and body["output"]["usage"]["prompt_tokens"] > 0
    assert body["replica"] in set(Replica.objects.values_list("id", flat=True))

    # Its KV block pool, as the replica publishes it: the API record shows it. Published
    # at most once a second, so the figures after the request may follow those from its load.
    def kv_after_the_request():
        kv = deployed.get(f"/api/replicas/{body['replica']}/").json()["kv"]
        return kv if kv and kv["allocations"] >= 1 else None

    kv = wait_until(kv_after_the_request, 30, "the KV figures of the pool the request used")
    assert kv["blocks_total"] > 0 and kv["block_tokens"] > 0

    submitted = deployed.post("/api/requests/", {"deployment": "tiny", "input": "Hello again"}, format="json").json()
    done = wait_until(
        lambda: (r := deployed.get(f"/api/requests/{submitted['id']}/").json())["status"] == "done" and r,
        60,
        "the submitted request to finish",
    )
    assert done["output"]["text"] is not None

    too_long = deployed.post(
        "/api/deployments/tiny/infer/", {"input": "word " * 2100, "params": {"max_tokens": 8}}, format="json"
    )
    assert too_long.status_code == 400 and "input too long" in too_long.json()["input"][0]


def test_a_replica_killed_mid_request_loses_nothing(deployed: APIClient):
    ids = [
        deployed.post(
            "/api/requests/",
            {"deployment": "tiny", "input": f"story {n}", "params": {"max_tokens": 200}},
            format="json",
        ).json()["id"]
        for n in range(4)
    ]
    running = wait_until(
        lambda: next((r for i in ids if (r := request_services.queue().get(i)).status == "running"), None),
        60,
        "a request to be running",
    )
    victim = Replica.objects.get(pk=running.replica)
    os.kill(victim.pid, signal.SIGKILL)

    finished = wait_until(
        lambda: (
            all(request_services.queue().get(i).final for i in ids) and [request_services.queue().get(i) for i in ids]
        ),
        120,
        "every request to finish",
    )
    assert [r.status for r in finished] == ["done"] * 4, [(r.status, r.error) for r in finished]
    rerun = next(r for r in finished if r.id == running.id)
    assert rerun.attempts == 2 and rerun.replica != victim.id, "run again on the other replica"


def test_the_only_replica_killed_mid_request_is_replaced_and_the_request_completes(
    agent, control_worker, staff, tmp_path
):
    request_services.queue.cache_clear()
    control_worker()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=6).path
    body = {"name": "tiny", "model": {"source": str(model)}, "memory": {"override_bytes": 200 * MiB}}
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    wait_until(serving(1), LOAD_TIMEOUT, "the replica to serve")
    victim = Replica.objects.get()
    request_id = staff.post(
        "/api/requests/", {"deployment": "tiny", "input": "a long tale", "params": {"max_tokens": 200}}, format="json"
    ).json()["id"]
    wait_until(lambda: request_services.queue().get(request_id).status == "running", 60, "the request to run")

    # Its client only waits: no new request will come to wake the deployment. The control plane must.
    os.kill(victim.pid, signal.SIGKILL)

    done = wait_until(
        lambda: (r := request_services.queue().get(request_id)).final and r, LOAD_TIMEOUT, "the request to end"
    )
    assert done.status == "done", done.error
    assert done.replica != victim.id and done.attempts == 2
    assert Replica.objects.get(pk=victim.id).state == "failed"


def test_scaling_down_while_requests_are_in_flight_loses_none(deployed: APIClient):
    ids = [
        deployed.post(
            "/api/requests/", {"deployment": "tiny", "input": f"tale {n}", "params": {"max_tokens": 120}}, format="json"
        ).json()["id"]
        for n in range(6)
    ]
    wait_until(
        lambda: any(request_services.queue().get(i).status == "running" for i in ids), 60, "requests to be running"
    )

    assert deployed.post("/api/deployments/tiny/scale/", {"replicas": 1}, format="json").status_code == 200

    finished = wait_until(
        lambda: (
            all(request_services.queue().get(i).final for i in ids) and [request_services.queue().get(i) for i in ids]
        ),
        180,
        "every request to finish",
    )
    assert [r.status for r in finished] == ["done"] * 6, [(r.status, r.error) for r in finished]


def test_an_idle_deployment_sleeps_then_sleeps_deeply_and_each_next_request_wakes_it_and_completes(
    agent, staff, tmp_path
):
    from scheduling.tasks import sleep_idle

    request_services.queue.cache_clear()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=4).path
    body = {
        "name": "tiny",
        "model": {"source": str(model)},
        "memory": {"override_bytes": 200 * MiB},
        "sleep": {"idle_timeout_s": 1},
    }
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    wait_until(serving(1), LOAD_TIMEOUT, "the replica to serve")
    first = staff.post("/api/deployments/tiny/infer/", {"input": "Hi", "timeout_s": 60}, format="json")
    assert first.status_code == 200
    replica = Replica.objects.get()

    # Beat is not running in tests: run its task until the replica has been idle long enough.
    wait_until(lambda: sleep_idle.apply().get() == [replica.id], 30, "the idle sweep to put the replica to sleep")
    wait_until(lambda: Replica.objects.get().state == "sleeping", 60, "the replica to sleep")

    again = staff.post("/api/deployments/tiny/infer/", {"input": "Hi again", "timeout_s": 120}, format="json")

    assert again.status_code == 200 and again.json()["status"] == "done", again.json()
    assert again.json()["replica"] == replica.id, "the cached replica was woken, not a new one placed"
    # The woken replica takes requests as soon as its weights are back; its `woken` report reaches
    # the books through the agents' worker on its own time, so it may land after the answer.
    wait_until(lambda: Replica.objects.get().state == "serving", 30, "the woken replica's report to land")

    # Deep sleep: asleep past sleep.deep_after_s, its process writes the weights to the node's
    # host copy and exits, holding no GPU memory; the next request starts a process from the copy.
    patched = staff.patch("/api/deployments/tiny/", {"sleep": {"deep_after_s": 0.5}}, format="json")
    assert patched.status_code == 200, patched.json()
    pid = Replica.objects.get().pid

    def swept_into_deep_sleep() -> bool:
        sleep_idle.apply().get()  # beat's task: to sleep when idle, then deeply when long asleep
        return Replica.objects.get().state == "deep_sleeping"

    wait_until(swept_into_deep_sleep, 90, "the sweeps to put the replica to sleep, then deeply")
    deep = staff.get(f"/api/replicas/{replica.id}/").json()
    assert deep["gpu_mem_bytes_by_id"] == {} and deep["node"] == "e2e"

    def exited() -> bool:
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    wait_until(exited, 30, "its process to exit")

    third = staff.post("/api/deployments/tiny/infer/", {"input": "Hi once more", "timeout_s": 120}, format="json")

    assert third.status_code == 200 and third.json()["status"] == "done", third.json()
    assert third.json()["replica"] == replica.id, "woken from its host copy, not loaded anew"
    wait_until(lambda: Replica.objects.get().state == "serving", 30, "the deep wake's report to land")
    assert Replica.objects.get().pid != pid, "a new process serves"


def the_openai_client_gets_plain_and_streamed_answers_from_real_replicas(live_server) -> None:
    import openai
    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    key = Token.objects.create(user=User.objects.get(username="ops")).key
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=120) as client:
        plain = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12
        )
        chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, stream=True))

    assert plain.choices[0].message.role == "assistant" and plain.usage.completion_tokens <= 12
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
    assert len(chunks) > 2, "text arrived as it was generated, not all at the end"
    assert isinstance(streamed, str)


# One deployment for the two checks that change nothing of it: its two replica processes take
# most of a test's time to load.
@pytest.mark.parametrize("deployed", ["own template"], indirect=True)
def test_infer_and_the_openai_client_get_text_from_real_replicas(deployed: APIClient, live_server, tmp_path):
    infer_generates_text_with_usage_and_polling_sees_the_same(deployed)
    the_openai_client_gets_plain_and_streamed_answers_from_real_replicas(live_server)
    replicas_were_forked_from_their_agents_template()
    agent_log = (tmp_path / "agent-e2e.log").read_text()
    assert "the templates' service at" in agent_log and "starting a template of our own" in agent_log


def replicas_were_forked_from_their_agents_template() -> None:
    # An agent on virtual GPUs forks its replicas from its template (inference.forkserver), which
    # it started itself (its templates' service did not answer): what served above ran there.
    for pid in Replica.objects.filter(state="serving").values_list("pid", flat=True):
        template = psutil.Process(pid).parent()
        assert template is not None and "inference.forkserver" in template.cmdline(), template
        assert "agent" in " ".join(template.parent().cmdline())


def test_agents_get_their_templates_from_the_nodes_templates_service_and_each_ends_with_its_agent(
    deployed: APIClient, template_service, tmp_path
):
    serving_pids = list(Replica.objects.filter(state="serving").values_list("pid", flat=True))
    templates = {psutil.Process(pid).parent() for pid in serving_pids}
    (template,) = templates  # the agent's one template, forked by the service
    assert template.pid in template_service.templates_since(0)
    assert "--listen" in template.parent().cmdline()
    assert os.getpgid(template.pid) == template.pid  # its group, with its replicas
    assert {os.getpgid(pid) for pid in serving_pids} == {template.pid}

    (agent,) = [p for p in psutil.Process().children() if p.cmdline()[1:3] == ["manage.py", "agent"]]
    agent.kill()

    # Its template hears the connection close, as the kernel closes a killed agent's end, and ends.
    template.wait(30)


def test_a_plain_pytorch_module_takes_json_tensors_on_infer(agent, staff):
    request_services.queue.cache_clear()
    body = {
        "name": "mlp",
        "model": {"source": "tests.support.models:tiny_mlp", "loader": "torch-module"},
        "memory": {"override_bytes": 64 * MiB},
    }
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    wait_until(
        lambda: Replica.objects.filter(deployment__name="mlp", state="serving").exists(), LOAD_TIMEOUT, "the module"
    )

    response = staff.post(
        "/api/deployments/mlp/infer/", {"input": [[0.5] * 64, [1.0] * 64], "timeout_s": 60}, format="json"
    )

    assert response.status_code == 200, response.json()
    output = response.json()["output"]
    assert output["shape"] == [2, 64] and len(output["output"]) == 2 and len(output["output"][0]) == 64
    wrong = staff.post("/api/deployments/mlp/infer/", {"input": [[1.0] * 3], "timeout_s": 60}, format="json")
    assert wrong.status_code == 400 and "cannot take this input" in wrong.json()["input"][0]
    text = staff.post("/api/deployments/mlp/infer/", {"input": "hello"}, format="json")
    assert text.status_code == 400 and "plain PyTorch module" in text.json()["input"][0]
