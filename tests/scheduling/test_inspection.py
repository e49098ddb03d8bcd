"""A deploy asks a node agent to read the model's files: the web process reads no
model file and runs no model code, and it answers 503 rather than hang when no agent can.

Here the node's task runs on a thread, as an agent's worker thread would, over the real Redis;
every test that starts a real agent (test_replica_lifecycle, test_serving, ...) deploys through
a real agent's own queue."""

from __future__ import annotations

import threading

import pytest

from gpuportal.wire.commands import node_queue
from gpuportal.wire.inspection import INSPECT_TASK, InspectModel, ModelReading
from inference.inspection import read_model
from scheduling.models import Deployment, DeploymentObserved, Node
from scheduling.services import dispatch
from tests.support.deployments import body

pytestmark = pytest.mark.nodes_read_models


class NodeWorker:
    """Takes what the control plane sends to a node's queue as that node's agent's worker would."""

    def __init__(self, answer: bool = True, silent: frozenset[str] = frozenset()):
        self.answer = answer
        # The queues of nodes whose workers take nothing (busy, or stuck while they beat).
        self.silent = silent
        self.sent: list[tuple[str, str, dict, float]] = []

    def send_task(self, name: str, *, args: list, queue: str, expires: float) -> None:
        self.sent.append((name, queue, args[0], expires))
        if self.answer and queue not in self.silent:
            threading.Thread(target=self._run, args=(args[0],)).start()

    def _run(self, payload: dict) -> None:
        from inference.tasks import inspect_model

        inspect_model(payload)


@pytest.fixture
def node_worker(monkeypatch) -> NodeWorker:
    worker = NodeWorker()
    monkeypatch.setattr(dispatch.app, "send_task", worker.send_task)
    return worker


@pytest.mark.django_db
def test_a_deploy_asks_a_node_to_read_the_model_and_reserves_what_it_read(cluster, staff, node_worker, tiny_model_dir):
    response = staff.post("/api/deployments/", body("tiny", tiny_model_dir, memory={"max_tokens": 512}), format="json")

    assert response.status_code == 201, response.json()
    ((_, queue, payload, _),) = [sent for sent in node_worker.sent if sent[0] == INSPECT_TASK]
    assert queue in {node_queue("node1"), node_queue("node2")}, "a node's own queue, which no other node may write to"
    assert InspectModel.decode(payload).source == str(tiny_model_dir)
    observed = DeploymentObserved.objects.get(deployment__name="tiny")
    read_here = read_model(str(tiny_model_dir), "transformers", "float32")
    assert observed.weight_bytes == read_here.weight_bytes > 0
    assert observed.memory_estimate_bytes > observed.weight_bytes


@pytest.mark.django_db
def test_a_source_the_node_cannot_read_is_a_400_naming_model_source_and_nothing_is_created(
    cluster, staff, node_worker, settings
):
    settings.GPUPORTAL_TORCH_MODULES = ("os", "json")  # listed by the operator, so a node is asked
    for source, loader, says in [
        ("/nowhere/" + "x" * 300, "transformers", "model.source"),
        ("os:getcwd", "torch-module", "returned a str, not a torch.nn.Module"),
        ("json:loads", "torch-module", "raised TypeError"),
    ]:
        spec = {"name": "bad", "model": {"source": source, "loader": loader}}
        response = staff.post("/api/deployments/", spec, format="json")
        assert response.status_code == 400, response.json()
        assert says in str(response.json()), response.json()
    assert not Deployment.objects.exists()


@pytest.mark.django_db
def test_with_no_node_online_a_deploy_answers_503_saying_so(cluster, staff, node_worker, tiny_model_dir):
    Node.objects.update(status=Node.Status.OFFLINE)

    response = staff.post("/api/deployments/", body("tiny", tiny_model_dir), format="json")

    assert response.status_code == 503
    assert "no node is online to read the model's files" in response.json()["detail"]
    assert node_worker.sent == [] and not Deployment.objects.exists()


@pytest.mark.django_db
def test_the_question_goes_to_the_online_node_heard_from_last(cluster, staff, node_worker, tiny_model_dir):
    from datetime import timedelta

    from django.utils import timezone

    now = timezone.now()
    Node.objects.filter(name="node1").update(last_heartbeat=now)
    Node.objects.filter(name="node2").update(last_heartbeat=now - timedelta(seconds=3))
    Node.objects.create(name="node3", queue=node_queue("node3"), status=Node.Status.OFFLINE, last_heartbeat=now)

    assert staff.post("/api/deployments/", body("tiny", tiny_model_dir), format="json").status_code == 201
    Node.objects.filter(name="node2").update(last_heartbeat=now + timedelta(seconds=3))
    assert staff.post("/api/deployments/", body("tiny2", tiny_model_dir), format="json").status_code == 201

    asked = [queue for name, queue, _, _ in node_worker.sent if name == INSPECT_TASK]
    assert asked == [node_queue("node1"), node_queue("node2")]


@pytest.mark.django_db
def test_while_the_node_asked_first_is_silent_the_next_is_asked_too_and_its_answer_counts(
    cluster, staff, monkeypatch, settings, tiny_model_dir
):
    from datetime import timedelta

    from django.utils import timezone

    Node.objects.filter(name="node1").update(last_heartbeat=timezone.now())
    Node.objects.filter(name="node2").update(last_heartbeat=timezone.now() - timedelta(seconds=3))
    worker = NodeWorker(silent=frozenset({node_queue("node1")}))
    monkeypatch.setattr(dispatch.app, "send_task", worker.send_task)
    settings.GPUPORTAL_INSPECT_HEDGE_S = 0.2

    response = staff.post("/api/deployments/", body("tiny", tiny_model_dir), format="json")

    assert response.status_code == 201, response.json()
    asked = [(queue, payload["reply_to"]) for name, queue, payload, _ in worker.sent if name == INSPECT_TASK]
    assert [queue for queue, _ in asked] == [node_queue("node1"), node_queue("node2")]
    assert asked[0][1] == asked[1][1], "both answer on one list: the first answer counts"
    assert DeploymentObserved.objects.get(deployment__name="tiny").weight_bytes > 0


@pytest.mark.django_db
def test_with_every_online_node_drained_a_deploy_is_a_409_that_says_so(cluster, staff, node_worker, tiny_model_dir):
    Node.objects.update(status=Node.Status.DRAINING)

    response = staff.post("/api/deployments/", body("tiny", tiny_model_dir), format="json")

    assert response.status_code == 409
    assert "every online node is drained" in response.json()["detail"]
    assert "/undrain/" in response.json()["detail"]
    assert node_worker.sent == [] and not Deployment.objects.exists()


@pytest.mark.django_db
def test_nodes_that_never_answer_make_the_deploy_a_503_after_the_wait_naming_them_not_a_hang(
    cluster, staff, monkeypatch, settings, tiny_model_dir
):
    silent = NodeWorker(answer=False)
    monkeypatch.setattr(dispatch.app, "send_task", silent.send_task)
    settings.GPUPORTAL_INSPECT_TIMEOUT_S, settings.GPUPORTAL_INSPECT_HEDGE_S = 1, 0.2

    response = staff.post("/api/deployments/", body("tiny", tiny_model_dir), format="json")

    assert response.status_code == 503
    detail = response.json()["detail"]
    assert "no answer to reading the model's files within 1 s from node(s) " in detail
    assert "node1" in detail and "node2" in detail, "each node asked, named"
    asked = [(queue, expires) for name, queue, _, expires in silent.sent if name == INSPECT_TASK]
    assert sorted(queue for queue, _ in asked) == [node_queue("node1"), node_queue("node2")]
    assert all(0 < expires <= 1 for _, expires in asked), "each question expires with the wait: none read for nobody"
    assert not Deployment.objects.exists()


def test_a_reading_survives_the_wire_as_it_was_read(tiny_model_dir):
    reading = read_model(str(tiny_model_dir), "transformers", "bfloat16")
    assert reading.shape is not None and reading.shape.dtype_bytes == 2
    assert ModelReading.from_record(reading.record()) == reading
    refused = read_model("/nowhere", "transformers", "float32")
    assert refused.refusal and ModelReading.from_record(refused.record()) == refused


@pytest.mark.django_db
def test_a_reading_that_breaks_on_the_node_is_answered_at_once_with_its_error(
    cluster, staff, node_worker, monkeypatch, tiny_model_dir
):
    import inference.tasks

    def broken(source: str, loader: str, dtype: str, adapters: str = "") -> ModelReading:
        raise KeyError("num_hidden_layers")

    monkeypatch.setattr(inference.tasks, "read_model", broken)

    response = staff.post("/api/deployments/", body("tiny", tiny_model_dir), format="json")

    assert response.status_code == 503
    assert "reading the model's files: KeyError: 'num_hidden_layers'" in response.json()["detail"]
    assert not Deployment.objects.exists()


@pytest.mark.django_db
def test_a_text_model_without_a_tokenizer_is_a_400_naming_model_source_at_deploy_not_at_its_first_request(
    cluster, staff, node_worker, tiny_model_dir, tmp_path
):
    import shutil

    weights_only = tmp_path / "weights-only"
    shutil.copytree(tiny_model_dir, weights_only)
    for pattern in ("tokenizer*", "vocab*", "merges*", "special_tokens_map.json"):
        for tokenizer_file in weights_only.glob(pattern):
            tokenizer_file.unlink()

    response = staff.post("/api/deployments/", body("mute", weights_only), format="json")

    assert response.status_code == 400, response.json()
    (says,) = response.json()["model.source"]
    assert says.startswith(f"{weights_only} has no tokenizer a replica can load")
    assert not Deployment.objects.exists()


# In a process of its own: transformers must not have been imported yet, as in an agent that has
# just started, for its lazy imports to race at all.
_PARALLEL_READS = """
import sys, threading
from inference.inspection import read_model
start, refusals = threading.Barrier(16), []
def read():
    start.wait()
    try:
        refusal = read_model(sys.argv[1], "transformers", "float32").refusal
    except Exception as exc:
        refusal = repr(exc)
    if refusal:
        refusals.append(refusal)
threads = [threading.Thread(target=read) for _ in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(refusals, "transformers" in sys.modules)
"""


@pytest.mark.slow
def test_sixteen_reads_at_once_on_a_fresh_agent_all_succeed(tmp_path):
    import json
    import subprocess
    import sys

    from inference.management.commands.make_tiny_model import write_tiny_model

    # A null num_key_value_heads is the config class's to read (inference.model_size.plain_config):
    # this model is read through transformers, whose lazy imports the sixteen threads race. Its
    # class reads null as one KV head per head, as this model has (one of each), so that its
    # weights still match its config.
    copy = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=0, log=lambda _: None).path
    config = json.loads((copy / "config.json").read_text())
    assert config["num_key_value_heads"] == config["num_attention_heads"]
    (copy / "config.json").write_text(json.dumps({**config, "num_key_value_heads": None}))

    done = subprocess.run(
        [sys.executable, "-c", _PARALLEL_READS, str(copy)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[] True", done.stdout[-2000:]


_READ_AND_SAY_WHAT_WAS_IMPORTED = """
import json, sys
from inference.inspection import read_model
reading = read_model(sys.argv[1], "transformers", "bfloat16")
print(json.dumps([reading.record(), sorted({"torch", "transformers"} & set(sys.modules))]))
"""


@pytest.mark.slow
def test_an_agent_reads_a_common_checkpoint_without_importing_torch_or_transformers(tiny_model_dir):
    import json
    import subprocess
    import sys

    # A node agent reads every model deployed on it; those imports would cost it 3 s of CPU and
    # 270 MB of memory that only its replicas need.
    done = subprocess.run(
        [sys.executable, "-c", _READ_AND_SAY_WHAT_WAS_IMPORTED, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == []
    # Its reading is this process's, which tests/gpuportal/test_memory.py checks against transformers'.
    assert ModelReading.from_record(record) == read_model(str(tiny_model_dir), "transformers", "bfloat16")


def test_a_tokenizer_json_the_library_cannot_read_is_refused_as_transformers_refuses_it(tiny_model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")

    reading = read_model(str(broken), "transformers", "float32")

    assert reading.refusal.startswith(f"{broken} has no tokenizer a replica can load")
