"""A deployment's LoRA adapters (`model.adapters`, gpuportal.wire.adapters), served beside its model:
deployed and counted, listed by /v1/models, reached as `deployment:adapter` through OpenAI's client
(the replica's serving loop over real Redis, with the adapters on its paged engine), refused by name
where they cannot be; and a replica host that reads them at its load and makes their stacks again
at each wake."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire import adapters as adapter_syntax
from gpuportal.wire import deployment_spec
from gpuportal.wire.commands import ReplicaSpec
from inference import lora
from inference.backends import Placement, ReplicaFailure, VirtualBackend
from inference.devices import virtual_gpus
from inference.event_stream import EventWriter
from inference.host import ReplicaHost
from inference.loaders import weight_allocation_bytes
from inference.serving import Server
from inference.supervisor import replica_argv
from scheduling.models import Deployment, Replica
from scheduling.services import requests as request_services
from scheduling.services.deployments import inspect_model
from scheduling.services.nodes import register_node
from tests.support import factories
from tests.support.adapters import SQL, merged_greedy, write_adapter
from tests.support.factories import NO_OVERHEAD
from tests.support.serving import host_for

MiB = 1024**2
GiB = 1024**3


@pytest.fixture(scope="module")
def sql_adapter(tmp_path_factory, tiny_model_dir) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return write_adapter(model, SQL, tmp_path_factory.mktemp("adapters") / "sql", seed=3)


# -- the syntax, the spec ----------------------------------------------------------------------------------


def test_adapters_are_written_name_equals_source_and_a_model_id_names_one_after_a_colon():
    assert adapter_syntax.canonical(" sql = /a/sql , chat=hf:org/chat ") == "sql=/a/sql,chat=hf:org/chat"
    assert adapter_syntax.split_model("llama-8b:sql") == ("llama-8b", "sql")
    assert adapter_syntax.split_model("llama-8b") == ("llama-8b", None)
    for bad, named in [
        ("sql", "must be name=source"),
        ("sql=/a,sql=/b", "named twice"),
        ("-x=/a", "adapter name '-x'"),
        (",".join(f"a{i}=/a" for i in range(33)), "at most 32 adapters"),
    ]:
        with pytest.raises(ValueError, match=named):
            adapter_syntax.parse(bad)
    problem = deployment_spec.adapters_problem({"adapters": "sql=/a", "loader": "transformers-embedding"})
    assert problem is not None and problem[0] == "model.adapters"


def test_a_replica_is_started_with_its_deployments_adapters():
    spec = ReplicaSpec("r1", "/srv/m", "transformers", "float32", (0,), {"0": GiB}, adapters="sql=/srv/a")
    argv = replica_argv(spec, "python")
    assert argv[argv.index("--adapters") + 1] == "sql=/srv/a"
    assert "--adapters" not in replica_argv(ReplicaSpec("r1", "/srv/m", "transformers", "float32", (0,), {"0": GiB}))


# -- deploying ---------------------------------------------------------------------------------------------


@pytest.fixture
def staff(transactional_db) -> APIClient:
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    client = APIClient()
    client.force_authenticate(User.objects.create_user("ops", is_staff=True))
    return client


def test_a_deploy_counts_its_adapters_stacks_in_the_estimate_as_weights(staff, tiny_model_dir, sql_adapter):
    source, named = str(tiny_model_dir), f"sql={sql_adapter}"
    body = {"name": "tiny", "model": {"source": source, "adapters": named}, "memory": {"max_tokens": 256}}

    answer = staff.post("/api/deployments/", body, format="json")

    assert answer.status_code == 201, answer.json()
    assert answer.json()["model"]["adapters"] == named
    stacks = lora.reading_bytes({"sql": str(sql_adapter)}, "float32")
    with_them, without = (
        inspect_model(source, "transformers", "float32", 256, named),
        inspect_model(source, "transformers", "float32", 256),
    )
    assert with_them.weight_bytes - without.weight_bytes == stacks > 0
    assert Deployment.objects.get(name="tiny").observed.memory_estimate_bytes == with_them.estimate_bytes


@pytest.mark.parametrize(
    ("adapters", "loader", "says"),
    [
        ("sql", "transformers", "must be name=source"),
        ("sql={missing}", "transformers", "adapter 'sql': .* has no adapter_config.json"),
        ("sql={adapter}", "transformers-embedding", "served beside a causal LM"),
    ],
)
def test_adapters_that_cannot_be_served_are_a_400_naming_model_adapters(
    staff, tiny_model_dir, sql_adapter, tmp_path, adapters, loader, says
):
    import re

    named = adapters.format(missing=tmp_path, adapter=sql_adapter)
    body = {"name": "tiny", "model": {"source": str(tiny_model_dir), "adapters": named, "loader": loader}}

    answer = staff.post("/api/deployments/", body, format="json")

    assert answer.status_code == 400, answer.json()
    # The input's own check answers as the body nests (model → adapters), a node's reading by its path.
    said = answer.json().get("model.adapters") or answer.json()["model"]["adapters"]
    assert re.search(says, " ".join(said)), answer.json()
    assert not Deployment.objects.exists()


# -- at run time: vLLM's load and unload ------------------------------------------------------------------


def test_vllms_load_and_unload_change_the_deployments_adapters_as_a_patch_does(staff, tiny_model_dir, sql_adapter):
    from scheduling.models import Event

    body = {"name": "tiny", "model": {"source": str(tiny_model_dir)}, "memory": {"max_tokens": 256}}
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    load = {"lora_name": "tiny:sql", "lora_path": str(sql_adapter)}

    loaded = staff.post("/v1/load_lora_adapter", load, format="json")
    again = staff.post("/v1/load_lora_adapter", load, format="json")
    served = Deployment.objects.get(name="tiny")
    unloaded = staff.post("/v1/unload_lora_adapter", {"lora_name": "tiny:sql"}, format="json")
    gone = staff.post("/v1/unload_lora_adapter", {"lora_name": "tiny:sql"}, format="json")

    assert loaded.status_code == 200 and loaded.content.decode().startswith("Success: LoRA adapter 'tiny:sql' added")
    assert served.model_adapters == f"sql={sql_adapter}"
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert "serves adapter 'sql' already" in again.json()["error"]["message"]
    assert unloaded.status_code == 200 and Deployment.objects.get(name="tiny").model_adapters == ""
    assert gone.status_code == 404 and "serves no adapter 'sql'" in gone.json()["error"]["message"]
    said = list(Event.objects.filter(deployment="tiny", kind="deployment.changed").values_list("reason", flat=True))
    assert any(r.startswith("adapter sql loaded by ops: model.adapters") for r in said), said
    assert any(r.startswith("adapter sql unloaded by ops") for r in said), said


def test_a_load_that_cannot_be_served_or_asked_by_a_user_changes_nothing(staff, tiny_model_dir, tmp_path):
    body = {"name": "tiny", "model": {"source": str(tiny_model_dir)}, "memory": {"max_tokens": 256}}
    assert staff.post("/api/deployments/", body, format="json").status_code == 201
    user = APIClient()
    user.force_authenticate(User.objects.create_user("alice"))

    cases = [
        (staff, {"lora_name": "tiny", "lora_path": str(tmp_path)}, 400, "lora_name"),
        (staff, {"lora_name": "tiny:sql"}, 400, "lora_path"),
        (staff, {"lora_name": "tiny:sql", "lora_path": str(tmp_path)}, 400, "model.adapters"),
        (staff, {"lora_name": "nope:sql", "lora_path": str(tmp_path)}, 404, None),
        (user, {"lora_name": "tiny:sql", "lora_path": str(tmp_path)}, 403, None),
    ]
    for client, asked, status, param in cases:
        answer = client.post("/v1/load_lora_adapter", asked, format="json")
        assert answer.status_code == status, (asked, answer.json())
        assert answer.json()["error"]["param"] == param, answer.json()
    assert Deployment.objects.get(name="tiny").model_adapters == ""


# -- serving -----------------------------------------------------------------------------------------------


@pytest.fixture
def replica(transactional_db, tiny_model_dir, sql_adapter) -> Replica:
    register_node("node1", virtual_gpus("node1", "1x1GiB", NO_OVERHEAD), virtual=True)
    request_services.queue.cache_clear()
    return factories.serving(
        "tiny", model_source=str(tiny_model_dir), model_adapters=f"sql={sql_adapter}", memory_override_bytes=MiB
    )


@pytest.fixture
def client(live_server, replica) -> Iterator[openai.OpenAI]:
    key = Token.objects.create(user=User.objects.create_user("alice")).key
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        yield client


@pytest.fixture
def served(replica, tiny_model_dir, sql_adapter) -> Iterator[Any]:
    """The replica's serving loop, here, over the tiny Llama and its adapter on a paged engine: the model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    host = host_for(model, tokenizer, adapters=lora.Adapters.read({"sql": str(sql_adapter)}))
    host.replica_id = replica.id
    server = Server(host, request_services.queue(), "tiny", poll_s=0.05)
    server.start()
    try:
        yield AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), tokenizer
    finally:
        server.stopped.set()
        server.join(10)


def test_models_lists_each_adapter_as_a_model_whose_parent_is_its_deployment(client, sql_adapter, tiny_model_dir):
    listed = {m.id: m for m in client.models.list()}

    assert list(listed) == ["tiny", "tiny:sql"]
    assert (listed["tiny:sql"].parent, listed["tiny:sql"].root) == ("tiny", str(sql_adapter))
    assert (listed["tiny"].parent, listed["tiny"].root) == (None, str(tiny_model_dir))
    assert client.models.retrieve("tiny:sql").parent == "tiny"
    with pytest.raises(openai.NotFoundError, match=r"serves no adapter 'chat' \(its adapters: sql\)"):
        client.models.retrieve("tiny:chat")


def test_a_completion_to_deployment_colon_adapter_is_the_adapters_answer(client, served, sql_adapter):
    model, tokenizer = served
    prompt = "Once upon a time"
    ids = tokenizer(prompt).input_ids

    adapted = client.completions.create(model="tiny:sql", prompt=prompt, max_tokens=8, temperature=0)
    base = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)

    assert adapted.model == "tiny:sql", "answered under the name it was asked by, as vLLM answers a LoRA's"
    expected = merged_greedy(model, sql_adapter, ids, 8)
    assert adapted.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert base.choices[0].text != adapted.choices[0].text, "the adapter changes the answer"


def test_an_adapter_the_deployment_does_not_serve_is_openais_model_not_found(client, served):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="tiny:chat", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["param"] == "model"
    assert "deployment 'tiny' serves no adapter 'chat' (its adapters: sql)" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError, match=r"The model `tinny:sql` does not exist; did you mean `tiny`"):
        client.completions.create(model="tinny:sql", prompt="hi")


def test_a_replica_refuses_an_adapter_it_was_not_started_with(client, replica, tiny_model_dir):
    """The deployment's adapters changed under a replica still serving the old set: its refusal
    names the model, whatever the control plane let through."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    host = host_for(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    host.replica_id = replica.id
    server = Server(host, request_services.queue(), "tiny", poll_s=0.05)
    server.start()
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny:sql", prompt="hi", max_tokens=2)
    finally:
        server.stopped.set()
        server.join(10)
    assert refused.value.body["param"] == "model"
    assert "this replica serves no adapters, and the request names 'sql'" in refused.value.body["message"]


# -- the replica host ------------------------------------------------------------------------------------------


def _host(model_dir: Path, adapters: str, gpus: tuple[int, ...] = (0,)) -> ReplicaHost:
    return ReplicaHost(
        replica_id="r1",
        source=str(model_dir),
        loader="transformers",
        dtype="float32",
        placement=Placement.parse(list(gpus), {str(g): GiB for g in gpus}, None),
        backend=VirtualBackend(),
        events=EventWriter(io.StringIO()),
        adapters=adapters,
    )


def test_a_replica_host_serves_its_adapters_after_a_sleep_and_counts_them_beside_its_weights(
    tiny_model_dir, sql_adapter
):
    host = _host(tiny_model_dir, f"sql={sql_adapter}")
    host.load()
    assert host.paged is not None and host.paged.adapters is not None and host.paged.adapters.names == ("sql",)
    stacks = host.adapters.nbytes("float32")
    assert host.footprint.weights_bytes == weight_allocation_bytes(host.model) + stacks
    before = {key: stack.b.clone() for key, stack in host.paged.lora.items()}

    host.sleep()
    assert host.paged is None, "the stacks go with the pool"
    host.wake([0], {"0": GiB}, None)

    assert host.paged is not None and host.paged.lora.keys() == before.keys()
    for key, b in before.items():
        assert torch.equal(host.paged.lora[key].b, b), key


def test_a_replica_whose_model_cannot_be_paged_fails_its_load_naming_its_adapters(tiny_model_dir, sql_adapter):
    host = _host(tiny_model_dir, f"sql={sql_adapter}", gpus=(0, 1))  # spread over two virtual GPUs: not paged

    with pytest.raises(ReplicaFailure, match="cannot serve adapters sql: adapters are served by the paged engine"):
        host.load()
