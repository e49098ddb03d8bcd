"""Loaders (inference.loaders) and `make_tiny_model`. No database, no hub.

This module also holds the factories the torch-module loader tests name (`tests.support.models:tiny_mlp`);
replica processes import it, so its top-level imports stay light: no Django, no transformers.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from inference.loaders import load_model, parameter_devices, tensor_bytes, tensor_bytes_by_device, validate_source

MiB = 1024**2
NOT_CALLABLE = 42


def not_a_module() -> str:
    return "hello"


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from inference.management.commands.make_tiny_model import write_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    write_tiny_model(path, size_mb=5, seed=0, log=quiet)
    return path


# -- make_tiny_model ---------------------------------------------------------------------------


def test_a_tiny_model_loads_and_generates_from_its_directory_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    inputs = tokenizer("Hello, world!", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=4, do_sample=False)

    assert output.shape[1] == inputs["input_ids"].shape[1] + 4
    assert tokenizer.decode(output[0]).startswith("Hello, world!")
    assert tokenizer.eos_token == "</s>" and tokenizer.pad_token == "<pad>" and tokenizer.unk_token == "<unk>"
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert weights == pytest.approx(5 * MiB, rel=0.03)


def test_the_tiny_model_weights_agree_with_the_memory_estimate(tiny_model_dir):
    from inference.loaders import buffer_tensors, weight_allocation_bytes
    from inference.model_size import shape_from_model_dir

    model = load_model(str(tiny_model_dir), "transformers", "float32")
    # What the replica counts as weights is what the estimate counts: the checkpoint's tensors as
    # allocated. The rotary table is a buffer, not a weight: counting it would take its bytes
    # out of the KV pool and leave the pool a block short.
    assert shape_from_model_dir(tiny_model_dir, "float32").weight_bytes == weight_allocation_bytes(model)
    assert buffer_tensors(model) and all(b.numel() == model.config.head_dim // 2 for b in buffer_tensors(model))


@pytest.mark.parametrize("size_mb", [1, 5, 20, 300])
def test_models_are_sized_to_the_megabytes_asked_for(size_mb):
    from inference.management.commands.make_tiny_model import llama_parameters, size_llama

    layers, hidden, intermediate = size_llama(size_mb * MiB / 4, vocab=512)
    assert llama_parameters(layers, hidden, intermediate, 512) * 4 == pytest.approx(size_mb * MiB, rel=0.03)
    assert hidden % 64 == 0 and intermediate % 8 == 0


def test_the_command_prints_progress_and_the_final_size(tmp_path):
    from django.core.management import call_command

    out = io.StringIO()
    call_command("make_tiny_model", str(tmp_path / "m"), "--size-mb", "1", "--seed", "3", stdout=out)

    text = out.getvalue()
    assert "training the tokenizer" in text and "building the model" in text
    assert "wrote" in text and "1.0 MiB" in text
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "m").iterdir()}


def test_the_command_writes_into_a_non_empty_directory_only_with_force(tmp_path):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(CommandError, match=r"exists and is not empty.*--force"):
        call_command("make_tiny_model", str(tmp_path), "--size-mb", "1", stdout=io.StringIO())

    call_command("make_tiny_model", str(tmp_path), "--size-mb", "1", "--force", stdout=io.StringIO())
    validate_source(str(tmp_path), "transformers")


@pytest.mark.parametrize(
    ("where", "args", "complaint"),
    [
        ("file", [], "is not a directory"),
        ("under-file", [], "cannot create"),
        ("fresh", ["--size-mb", "0"], "--size-mb must be positive"),
    ],
)
def test_the_command_rejects_a_bad_directory_in_one_line(tmp_path, where, args, complaint):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    (tmp_path / "file").write_text("")
    target = {"file": tmp_path / "file", "under-file": tmp_path / "file" / "model", "fresh": tmp_path / "new"}[where]
    with pytest.raises(CommandError, match=complaint) as err:
        call_command("make_tiny_model", str(target), *args, stdout=io.StringIO())
    assert "\n" not in str(err.value)


# -- loaders -----------------------------------------------------------------------------------


def test_the_transformers_loader_reads_a_local_directory_in_the_dtype_asked(tiny_model_dir):
    model = load_model(str(tiny_model_dir), "transformers", "bfloat16")

    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training
    assert parameter_devices(model) == {"cpu"}


def test_the_torch_module_loader_calls_the_factory_and_casts(tiny_model_dir):
    model = load_model("tests.support.models:tiny_mlp", "torch-module", "float16")

    assert isinstance(model, nn.Sequential) and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    # BatchNorm's step counter is an integer buffer: a cast to float16 must leave it alone.
    assert model[3].num_batches_tracked.dtype == torch.int64
    params = sum(p.numel() for p in model.parameters())
    floats = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert tensor_bytes(model) == (params + floats) * 2 + 8


def test_tensor_bytes_counts_buffers_and_tied_weights_once():
    embed = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    model.register_buffer("table", torch.zeros(10, dtype=torch.float64))

    assert tensor_bytes(model) == 100 * 16 * 4 + 10 * 8
    assert tensor_bytes_by_device(model) == {"cpu": 100 * 16 * 4 + 10 * 8}


def test_valid_sources_pass(tiny_model_dir):
    validate_source(str(tiny_model_dir), "transformers")
    validate_source("tests.support.models:tiny_mlp", "torch-module")


def _bad_dir(tmp_path: Path, kind: str) -> str:
    root = tmp_path / "model"
    if kind == "missing":
        return str(root)
    if kind == "file":
        root.write_text("")
        return str(root)
    root.mkdir()
    if kind == "bad-json":
        (root / "config.json").write_text("{not json")
    if kind == "no-weights":
        (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (root / "tokenizer.json").write_text("{}")
    return str(root)


@pytest.mark.parametrize(
    ("kind", "complaint"),
    [
        ("missing", "not a model directory: .* does not exist"),
        ("file", "not a model directory: .* is not a directory"),
        ("empty", "not a model directory: no config.json in"),
        ("bad-json", "config.json is not valid JSON"),
        ("no-weights", r"no weights in .* \(expected \*.safetensors or pytorch_model\*.bin\)"),
    ],
)
def test_a_source_that_is_not_a_model_directory_is_refused_saying_why(tmp_path, kind, complaint):
    with pytest.raises(ValueError, match=complaint):
        validate_source(_bad_dir(tmp_path, kind), "transformers")


@pytest.mark.parametrize(
    ("source", "complaint"),
    [
        ("tests.inference.test_loaders", r"not a factory path: .* \(expected 'package.module:factory'\)"),
        ("tests/inference/test_loaders.py:tiny_mlp", "not a factory path"),
        ("no_such_package_xyz.models:build", "cannot import module 'no_such_package_xyz.models'"),
        (
            "tests.inference.test_loaders:missing_factory",
            "not found: 'tests.inference.test_loaders' has no 'missing_factory'",
        ),
        ("tests.inference.test_loaders:NOT_CALLABLE", "is not callable"),
    ],
)
def test_a_factory_path_that_does_not_import_is_refused_saying_why(source, complaint):
    with pytest.raises(ValueError, match=complaint):
        validate_source(source, "torch-module")


@pytest.mark.parametrize(
    ("source", "loader", "dtype", "complaint"),
    [
        ("tests.support.models:tiny_mlp", "onnx", "float32", "unknown loader 'onnx'"),
        ("  ", "transformers", "float32", "model source is empty"),
        ("tests.support.models:tiny_mlp", "torch-module", "int4", "unknown dtype 'int4'"),
        (
            "tests.inference.test_loaders:not_a_module",
            "torch-module",
            "float32",
            "returned a str, not a torch.nn.Module",
        ),
    ],
)
def test_load_model_refuses_bad_requests_saying_why(source, loader, dtype, complaint):
    with pytest.raises(ValueError, match=complaint):
        load_model(source, loader, dtype)


def test_a_module_without_parameters_serves_a_forward_pass_instead_of_an_empty_error():
    import torch

    from inference.serving import Executor

    answer = Executor(torch.nn.Identity(), None).forward([[1.0, 2.5]])

    assert answer == {"output": [[1.0, 2.5]], "shape": [1, 2]}


def test_a_prompt_too_big_for_the_context_is_refused_by_its_size_before_it_is_tokenised(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuportal.wire.requestqueue import Request
    from inference.errors import BadInput
    from inference.serving import Executor

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    executor = Executor(model, tokenizer)
    bound, context, longest = executor._prompt_bound
    assert context == model.config.max_position_embeddings
    assert longest == max(len(token.encode()) for token in tokenizer.get_vocab()) and bound == context * longest

    class NeverTokenises:
        def __call__(self, *args, **kwargs):
            raise AssertionError("a prompt that can never fit was tokenised")

    executor.tokenizer = NeverTokenises()
    oversized = Request(id="r", deployment="tiny", kind="generate", input="é" * (bound // 2 + 1))
    with pytest.raises(
        BadInput, match=rf"input too long: {2 * (bound // 2 + 1)} bytes can never fit .* {context} tokens"
    ):
        executor.run(oversized, None)
    with pytest.raises(BadInput, match="can never fit"):
        executor.sequence(oversized, None)
    executor.refuse_oversized("a" * bound)  # at the bound it may fit: its tokens decide, as before


def test_a_tokenizers_vocabulary_is_read_for_its_longest_token_once_not_at_every_request(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuportal.wire.requestqueue import Request
    from inference.serving import Executor

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    reads = []
    vocabulary = tokenizer.get_vocab
    tokenizer.get_vocab = lambda: reads.append(1) or vocabulary()

    for n in range(3):  # an Executor a request, as a replica's host makes them
        request = Request(id=f"r{n}", deployment="tiny", kind="generate", input="Hello", params={"max_tokens": 1})
        Executor(model, tokenizer).sequence(request, None)

    # 150,000 tokens took tens of milliseconds a request, on the thread that steps the batch.
    assert len(reads) == 1


@pytest.mark.parametrize(
    ("source", "hint"),
    [
        (
            "Qwen/Qwen2.5-0.5B-Instruct",
            "pull it first (`gpuportal pull Qwen/Qwen2.5-0.5B-Instruct`), then deploy hf:Qwen/Qwen2.5-0.5B-Instruct",
        ),
        ("meta-llama/Llama-3.2-1B", "holds no model meta-llama/Llama-3.2-1B"),
        ("/models/missing", None),
        ("./missing/model", None),
        ("missing", None),
    ],
)
def test_a_missing_source_that_reads_as_a_hugging_face_name_is_told_the_hf_spelling(
    source, hint, tmp_path, monkeypatch
):
    from tests.support.hub import use_cache

    use_cache(monkeypatch, tmp_path / "empty-cache")
    with pytest.raises(ValueError, match=r"not a model directory: .* does not exist") as refused:
        validate_source(source, "transformers")

    if hint is None:
        assert "hf:" not in str(refused.value)
    else:
        assert hint in str(refused.value)


def test_a_bare_hugging_face_name_the_cache_holds_is_loaded_from_it_as_vllm_takes_one(
    tiny_model_dir, tmp_path, monkeypatch
):
    from inference.hub import local_model_dir
    from tests.support.hub import cache_model, use_cache

    use_cache(monkeypatch, tmp_path / "cache")
    snapshot = cache_model(tmp_path / "cache", "acme/tiny-llm", tiny_model_dir, link=True)

    assert local_model_dir("acme/tiny-llm") == snapshot
    validate_source("acme/tiny-llm", "transformers")
    # A directory of that name here is still the directory.
    (tmp_path / "acme" / "tiny-llm").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert local_model_dir("acme/tiny-llm") == Path("acme/tiny-llm")


def test_a_hub_model_with_no_org_is_read_from_the_cache_by_its_name_alone(tiny_model_dir, tmp_path, monkeypatch):
    # As the hub still serves its oldest models: gpt2, distilgpt2, t5-small.
    from inference.hub import local_model_dir
    from tests.support.hub import cache_model, use_cache

    use_cache(monkeypatch, tmp_path / "cache")
    snapshot = cache_model(tmp_path / "cache", "tinyllm", tiny_model_dir, link=True)

    assert local_model_dir("hf:tinyllm") == snapshot
    assert local_model_dir("tinyllm") == snapshot
    validate_source("hf:tinyllm", "transformers")
