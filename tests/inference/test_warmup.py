"""A failover standby's warm-up (inference.warmup): the serving path run once over a one-layer
skeleton of the model, on the standby's device, leaving the model itself alone. On the CPU here;
on a GPU the same function runs from CudaBackend.load_to_cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from inference import warmup
from inference.paged import PagedModel, unsupported_reason


@pytest.fixture
def tiny_llama(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()


def _snapshot(model) -> dict[str, tuple[int, torch.Tensor]]:
    return {name: (t.data_ptr(), t.detach().clone()) for name, t in model.state_dict().items()}


def test_a_warm_up_runs_a_request_through_the_paged_engine_on_a_skeleton_and_leaves_the_model_alone(tiny_llama):
    assert unsupported_reason(tiny_llama) is None
    before = _snapshot(tiny_llama)
    layers = tiny_llama.config.num_hidden_layers

    done = warmup.warm_up(tiny_llama, "cpu")

    assert done.skipped is None and done.path == "paged"
    assert done.tokens == warmup.NEW_TOKENS
    # One layer and one (tied) vocabulary table: smaller than the model, however many layers it has.
    model_bytes = sum(t.numel() * t.element_size() for t in tiny_llama.parameters())
    assert 0 < done.skeleton_bytes < model_bytes
    after = _snapshot(tiny_llama)
    assert after.keys() == before.keys()
    for name, (ptr, value) in before.items():
        assert after[name][0] == ptr, f"{name} moved"
        assert torch.equal(after[name][1], value), f"{name} changed"
    assert tiny_llama.config.num_hidden_layers == layers  # the skeleton's config is a copy
    assert {p.device.type for p in tiny_llama.parameters()} == {"cpu"}
    assert done.peak_bytes is None and done.left_bytes is None  # allocator figures: on a GPU only
    event = done.as_event()
    assert event["path"] == "paged" and event["tokens"] == warmup.NEW_TOKENS and event["skipped"] is None


def test_a_warm_up_runs_in_the_dtype_it_is_given(tiny_llama):
    done = warmup.warm_up(tiny_llama, "cpu", torch.bfloat16)
    assert done.skipped is None and done.path == "paged" and done.tokens == warmup.NEW_TOKENS
    assert next(tiny_llama.parameters()).dtype == torch.float32


def test_a_failing_forward_is_reported_as_skipped_not_raised(tiny_llama, monkeypatch):
    def broken(self, batch):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(PagedModel, "forward", broken)
    done = warmup.warm_up(tiny_llama, "cpu")

    assert done.path is None and done.tokens == 0
    assert "OutOfMemoryError" in done.skipped and "out of memory" in done.skipped


def test_a_skeleton_that_cannot_be_built_is_reported_as_skipped(tiny_llama, monkeypatch):
    def no_room(*args, **kwargs):
        raise RuntimeError("no room for the skeleton")

    monkeypatch.setattr(type(tiny_llama), "_from_config", no_room)
    done = warmup.warm_up(tiny_llama, "cpu")
    assert done.path is None and "no room for the skeleton" in done.skipped


def test_a_model_the_paged_engine_cannot_run_is_warmed_up_through_generate():
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=128, n_positions=64)).eval()
    assert unsupported_reason(model) is not None
    before = _snapshot(model)

    done = warmup.warm_up(model, "cpu")

    assert done.skipped is None and done.path == "generate" and done.tokens == warmup.NEW_TOKENS
    assert all(torch.equal(model.state_dict()[name], value) for name, (_, value) in before.items())
    assert model.config.n_layer == 3


def test_a_model_to_be_spread_over_gpus_is_warmed_up_through_generate(tiny_llama):
    done = warmup.warm_up(tiny_llama, "cpu", paged=False)
    assert done.skipped is None and done.path == "generate" and done.tokens == warmup.NEW_TOKENS


def test_a_module_without_a_transformers_config_is_skipped():
    done = warmup.warm_up(torch.nn.Linear(4, 4), "cpu")
    assert done.path is None and "no config" in done.skipped


def test_the_warm_up_leaves_the_random_generators_as_they_were(tiny_llama):
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    warmup.warm_up(tiny_llama, "cpu")
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.gpu
def test_on_a_gpu_the_warm_up_gives_back_every_byte_it_took(tiny_llama):
    done = warmup.warm_up(tiny_llama, "cuda:0")
    assert done.skipped is None and done.path == "paged"
    assert done.peak_bytes is not None and done.peak_bytes > 0
    assert done.left_bytes == 0 == torch.cuda.memory_reserved(0)
    assert {p.device.type for p in tiny_llama.parameters()} == {"cpu"}
