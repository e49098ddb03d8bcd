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
