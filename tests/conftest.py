"""Fixtures shared across feature files."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A small causal LM on disk (random weights, safetensors), written once per session."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def dispatched(monkeypatch) -> list[tuple[str, str, list]]:
    """Tasks the control plane sends to node agents, recorded instead of sent: (queue, task, args)."""
    from gpuportal.celery import app

    sent: list[tuple[str, str, list]] = []
    monkeypatch.setattr(app, "send_task", lambda name, args=None, queue=None, **kw: sent.append((queue, name, args)))
    return sent


@pytest.fixture
def cluster(db) -> None:
    """Two virtual nodes of two 1 GiB GPUs each."""
    from inference.devices import virtual_gpus
    from scheduling.services.nodes import register_node

    register_node("node1", virtual_gpus("node1", "2x1GiB"), virtual=True)
    register_node("node2", virtual_gpus("node2", "2x1GiB"), virtual=True)


@pytest.fixture
def staff(db):
    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(User.objects.create_user("ops", is_staff=True))
    return client


@pytest.fixture
def api(staff, django_capture_on_commit_callbacks, dispatched):
    """POST/PATCH/DELETE as staff, running what would run after commit (the dispatches)."""

    def call(method: str, path: str, body: dict | None = None):
        with django_capture_on_commit_callbacks(execute=True):
            return getattr(staff, method)(path, body, format="json")

    return call


@pytest.fixture
def agent(tmp_path):
    """A real node agent, `e2e` with 2x1GiB virtual GPUs, on this test's database and Redis
    (tests using it need `django_db(transaction=True)` so the agent sees their rows)."""
    import os
    import signal
    import subprocess
    import sys

    from django.conf import settings

    from scheduling.models import Node
    from tests.processes import database_url_of_this_test, wait_until

    env = {
        **os.environ,
        "DATABASE_URL": database_url_of_this_test(),
        "REDIS_URL": settings.REDIS_URL,
        "GPUPORTAL_DATA_DIR": str(tmp_path),
        "GPUPORTAL_HEARTBEAT_S": "1",
    }
    log = open(tmp_path / "agent.log", "w+")  # noqa: SIM115 - read back when the test fails
    process = subprocess.Popen(
        [sys.executable, "manage.py", "agent", "--node", "e2e", "--virtual-gpus", "2x1GiB"],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: Node.objects.filter(name="e2e", status="online").exists(), 60, "the agent to register")
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        log.seek(0)
        print(log.read()[-5000:])  # shown by pytest only when the test failed
