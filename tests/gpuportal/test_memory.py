"""The memory need (gpuportal.wire.memory) and reading a model's shape (inference.model_size). No database."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuportal.wire import memory
from gpuportal.wire.memory import (
    ACTIVATION_FLOOR_BYTES,
    MiB,
    ModelShape,
    NeedInputs,
    activation_reserve_bytes,
    allocation_bytes,
    allocations_bytes,
    estimate,
    kv_block_bytes,
    kv_cache_bytes,
    kv_pool_blocks,
    kv_pool_bytes,
    ndif_fraction,
    need_bytes,
    need_for,
)
from inference.model_size import _PLAIN_TYPES, config_values, load_config, plain_config, shape_from_model_dir

# 2 layers, 4 KV heads of 64 dims, fp16.
SHAPE = ModelShape(
    weight_bytes=100 * MiB,
    num_layers=2,
    num_kv_heads=4,
    head_dim=64,
    dtype_bytes=2,
    hidden_size=256,
    intermediate_size=1024,
)


# --- the formula -------------------------------------------------------------------------------


def test_kv_block_bytes_by_hand():
    # K and V × 16 tokens × 4 heads × 64 dims × 2 bytes × 2 layers
    assert kv_block_bytes(SHAPE) == 2 * 16 * 4 * 64 * 2 * 2 == 32768
    assert kv_block_bytes(SHAPE, block_tokens=1) == 2048


def test_kv_cache_rounds_up_to_whole_blocks():
    assert kv_cache_bytes(SHAPE, 0) == 0
    assert kv_cache_bytes(SHAPE, 1) == 32768
    assert kv_cache_bytes(SHAPE, 16) == 32768
    assert kv_cache_bytes(SHAPE, 17) == 2 * 32768
    assert kv_cache_bytes(SHAPE, 2048) == 128 * 32768 == 4 * MiB


def test_activation_reserve_has_a_floor_and_grows_with_tokens():
    assert activation_reserve_bytes(SHAPE, 0) == ACTIVATION_FLOOR_BYTES
    assert activation_reserve_bytes(SHAPE, 16) == ACTIVATION_FLOOR_BYTES
    # (3 × 256 + 3 × 1024) × 2 bytes × 2 slack = 15360 bytes per token
    assert activation_reserve_bytes(SHAPE, 65536) == 15360 * 65536
    # No intermediate size in the config: 4 × hidden.
    plain = ModelShape(weight_bytes=0, num_layers=1, num_kv_heads=1, head_dim=1, dtype_bytes=2, hidden_size=256)
    assert activation_reserve_bytes(plain, 65536) == activation_reserve_bytes(SHAPE, 65536)


def test_estimate_breakdown_adds_up():
    est = estimate(SHAPE, max_tokens=2048, cuda_context_bytes=500 * MiB)
    assert est.weights_bytes == 100 * MiB
    assert est.kv_bytes == 4 * MiB
    assert est.kv_blocks == 128 and est.kv_block_bytes == 32768
    assert est.activation_bytes == activation_reserve_bytes(SHAPE, 2048)
    assert est.context_bytes == 500 * MiB
    assert est.total_bytes == 100 * MiB + 4 * MiB + est.activation_bytes + 500 * MiB
    assert "kv 4 MiB (128 blocks for 2048 tokens)" in est.describe()
    # A virtual GPU has no CUDA context.
    assert estimate(SHAPE, max_tokens=2048, cuda_context_bytes=0).total_bytes == est.total_bytes - 500 * MiB


def test_pool_inside_the_estimated_cap_is_what_was_estimated():
    for context in (0, 500 * MiB):
        for tokens in (1, 16, 100, 2048, 100_000):
            est = estimate(SHAPE, max_tokens=tokens, cuda_context_bytes=context)
            blocks = kv_pool_blocks(SHAPE, cap_bytes=est.total_bytes, max_tokens=tokens, cuda_context_bytes=context)
            assert blocks == est.kv_blocks
            assert kv_pool_bytes(SHAPE, blocks) == est.kv_bytes
    est = estimate(SHAPE, max_tokens=2048, cuda_context_bytes=0)
    more = kv_pool_blocks(
        SHAPE, cap_bytes=est.total_bytes + 10 * est.kv_block_bytes, max_tokens=2048, cuda_context_bytes=0
    )
    assert more == est.kv_blocks + 10
    assert kv_pool_blocks(SHAPE, cap_bytes=1, max_tokens=2048, cuda_context_bytes=0) == 0


@given(
    layers=st.integers(1, 128),
    kv_heads=st.integers(1, 64),
    head_dim=st.sampled_from([32, 64, 80, 128, 256]),
    dtype=st.sampled_from([2, 4]),
    hidden=st.integers(1, 16384),
    weights=st.integers(0, 2**40),
    tokens=st.integers(0, 1_000_000),
    block=st.sampled_from([1, 8, 16, 32]),
    context=st.sampled_from([0, 500 * MiB]),
    extra=st.integers(0, 10**9),
)
def test_pool_and_estimate_share_one_formula(
    layers, kv_heads, head_dim, dtype, hidden, weights, tokens, block, context, extra
):
    shape = ModelShape(
        weight_bytes=weights,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=dtype,
        hidden_size=hidden,
    )
    est = estimate(shape, max_tokens=tokens, cuda_context_bytes=context, block_tokens=block)
    assert est.kv_blocks * block >= tokens > (est.kv_blocks - 1) * block
    cap = est.total_bytes + extra
    blocks = kv_pool_blocks(shape, cap_bytes=cap, max_tokens=tokens, cuda_context_bytes=context, block_tokens=block)
    # Never fewer blocks than reserved for, and the pool never spills past the cap.
    assert blocks == est.kv_blocks + extra // est.kv_block_bytes
    assert est.total_bytes - est.kv_bytes + kv_pool_bytes(shape, blocks, block) <= cap


def test_invalid_inputs_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelShape(weight_bytes=1, num_layers=1, num_kv_heads=0, head_dim=1, dtype_bytes=2, hidden_size=1)
    with pytest.raises(ValueError, match="max_tokens"):
        estimate(SHAPE, max_tokens=-1, cuda_context_bytes=0)
    with pytest.raises(ValueError, match="cuda_context_bytes"):
        estimate(SHAPE, max_tokens=1, cuda_context_bytes=-1)
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        memory.dtype_bytes("int4")
    assert memory.dtype_bytes("torch.bfloat16") == 2


# --- order of trust ----------------------------------------------------------------------------


def test_need_prefers_override_then_measured_then_estimate():
    est = estimate(SHAPE, max_tokens=2048, cuda_context_bytes=0)
    assert need_bytes(override=5, measured=6, estimate=est) == memory.Need(5, "override")
    assert need_bytes(override=None, measured=734 * MiB, estimate=est) == memory.Need(734 * MiB, "measured")
    assert need_bytes(override=None, measured=None, estimate=est) == memory.Need(est.total_bytes, "estimate")
    assert need_bytes(override=None, measured=None, estimate=123) == memory.Need(123, "estimate")
    # Zero is a placeholder, not a measurement.
    assert need_bytes(override=0, measured=0, estimate=123).source == "estimate"
    with pytest.raises(ValueError, match="no memory need"):
        need_bytes(override=None, measured=None, estimate=None)


def test_need_reads_well_in_events():
    assert str(memory.Need(734 * MiB, "measured")) == "need 734 MiB (measured)"
    assert str(memory.Need(14 * 1024 * MiB, "estimate")) == "need 14.0 GiB (estimate)"


# --- the seed's policy -------------------------------------------------------------------------


def test_ndif_is_three_times_the_model_and_shares_only_below_four_fifths():
    assert memory.ndif_need(1000).bytes == 3000
    gpu = 1000
    assert ndif_fraction(799, gpu) == pytest.approx(0.799)
    assert ndif_fraction(800, gpu) == 1.0
    assert ndif_fraction(950, gpu) == 1.0
    assert ndif_fraction(5000, gpu) == 1.0


def test_policies_by_name():
    inputs = NeedInputs(weight_bytes=100, estimate_bytes=250, override_bytes=None, measured_bytes=180)
    assert need_for("gpuportal", inputs) == memory.Need(180, "measured")
    # The seed had no override or measurement, and the comparison keeps it that way.
    assert need_for("ndif", NeedInputs(weight_bytes=100, override_bytes=50)) == memory.Need(300, "ndif")
    assert memory.policy("gpuportal").fraction(900, 1000) == pytest.approx(0.9)
    assert memory.policy("ndif").fraction(900, 1000) == 1.0
    assert set(memory.POLICIES) == {"gpuportal", "ndif"}
    with pytest.raises(ValueError, match="unknown memory policy 'vllm'"):
        need_for("vllm", inputs)
    with pytest.raises(ValueError, match="weight bytes"):
        need_for("ndif", NeedInputs(estimate_bytes=1))


# --- reading a model directory -----------------------------------------------------------------


def tiny_llama(tie: bool = False, dtype=None):
    # Imported here so collecting the whole suite does not pay for transformers.
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(config)
    return model.to(getattr(torch, dtype)) if dtype is not None else model


def param_bytes(model, element_size: int | None = None) -> int:
    """The parameters as PyTorch's caching allocator holds them, one allocation each, in their own
    element size or `element_size` (a run dtype): what the GPU really gives them."""
    return allocations_bytes(p.numel() * (element_size or p.element_size()) for p in model.parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Any]:
    # transformers 5 always writes safetensors (its save_pretrained has no safe_serialization switch).
    model = tiny_llama()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path, model


def test_weights_are_counted_as_the_allocator_holds_them(saved):
    path, model = saved
    raw = sum(p.numel() * p.element_size() for p in model.parameters())
    # Each of the 21 tensors is rounded up to 512 bytes (none is above 1 MiB here).
    assert shape_from_model_dir(path).weight_bytes == param_bytes(model) > raw
    assert allocation_bytes(1) == 512 and allocation_bytes(512) == 512 and allocation_bytes(513) == 1024
    assert allocation_bytes(MiB) == MiB and allocation_bytes(MiB + 1) == 2 * MiB
    assert allocation_bytes(3 * MiB) == 4 * MiB and allocation_bytes(0) == 0


def test_shape_from_safetensors_headers(saved):
    path, model = saved
    shape = shape_from_model_dir(path)
    assert shape == ModelShape(
        weight_bytes=param_bytes(model),
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        dtype_bytes=4,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=128,
    )


def test_weights_are_rescaled_to_the_run_dtype(saved):
    path, model = saved
    half = shape_from_model_dir(path, "float16")
    assert half.weight_bytes == param_bytes(model, 2)
    assert half.dtype_bytes == 2
    assert shape_from_model_dir(path, "torch.bfloat16").weight_bytes == param_bytes(model, 2)


def test_bfloat16_checkpoint_keeps_its_dtype_by_default(tmp_path):
    model = tiny_llama(dtype="bfloat16")
    model.save_pretrained(tmp_path)
    assert shape_from_model_dir(tmp_path).weight_bytes == param_bytes(model)
    assert shape_from_model_dir(tmp_path).dtype_bytes == 2
    assert shape_from_model_dir(tmp_path, "float32").weight_bytes == param_bytes(model, 4)


def test_meta_device_build_gives_the_same_bytes(saved, tmp_path):
    path, model = saved
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    assert shape_from_model_dir(tmp_path) == shape_from_model_dir(path)
    assert shape_from_model_dir(tmp_path, "float16").weight_bytes == param_bytes(model, 2)


def test_tied_embeddings_are_counted_once(tmp_path):
    model = tiny_llama(tie=True)
    model.save_pretrained(tmp_path / "st")
    model.config.save_pretrained(tmp_path / "meta")
    assert shape_from_model_dir(tmp_path / "st").weight_bytes == param_bytes(model)
    assert shape_from_model_dir(tmp_path / "meta").weight_bytes == param_bytes(model)


def test_gpt2_names_and_defaults(tmp_path):
    # GPT-2 names its fields n_layer / n_head / n_embd and has no KV-head or head_dim entries.
    import transformers

    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "st")
    config.save_pretrained(tmp_path / "meta")
    shape = shape_from_model_dir(tmp_path / "st")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.hidden_size) == (2, 4, 16, 64)
    assert shape.weight_bytes == param_bytes(model)
    assert shape_from_model_dir(tmp_path / "meta") == shape


def test_sharded_checkpoint_follows_its_index(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    # A stray consolidated copy beside the shards is not counted.
    (tmp_path / "consolidated.safetensors").write_bytes(next(tmp_path.glob("model-*.safetensors")).read_bytes())
    assert shape_from_model_dir(tmp_path).weight_bytes == param_bytes(model)


def test_estimate_from_a_real_directory(saved):
    path, model = saved
    shape = shape_from_model_dir(path, "float16")
    est = estimate(shape, max_tokens=2048, cuda_context_bytes=0)
    # 2 × 16 tokens × 2 KV heads × 16 dims × 2 bytes × 2 layers
    assert est.kv_block_bytes == 4096
    assert est.kv_bytes == 128 * 4096
    assert est.total_bytes == param_bytes(model, 2) + 128 * 4096 + ACTIVATION_FLOOR_BYTES


@st.composite
def saved_configs(draw) -> dict[str, Any]:
    """A config.json as checkpoints of the common types write it, some values left out."""
    heads = draw(st.integers(1, 16))
    config = {
        "model_type": draw(st.sampled_from(sorted(_PLAIN_TYPES))),
        "num_hidden_layers": draw(st.integers(1, 80)),
        "num_attention_heads": heads,
        "hidden_size": heads * draw(st.sampled_from([8, 64, 128])),
        "intermediate_size": draw(st.integers(1, 30000)),
        "vocab_size": draw(st.integers(1, 200000)),
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0] + [heads])),
        "head_dim": draw(st.sampled_from([64, 128, 256])),
        draw(st.sampled_from(["dtype", "torch_dtype"])): draw(st.sampled_from(["float32", "bfloat16", "float16"])),
    }
    for optional in ("num_key_value_heads", "head_dim", "dtype", "torch_dtype"):
        if draw(st.booleans()):
            config.pop(optional, None)
    return config


@given(config=saved_configs())
def test_the_common_model_types_are_read_from_config_json_as_transformers_reads_them(config, tmp_path_factory):
    root = tmp_path_factory.mktemp("config")
    (root / "config.json").write_text(json.dumps(config))

    assert plain_config(root) == config_values(load_config(root), root)


def test_another_type_a_null_or_a_left_out_size_is_left_to_transformers(tmp_path):
    llama = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 128,
    }
    assert plain_config_of(tmp_path, llama) is not None
    # Gemma's class sets head_dim on its own (256), not hidden_size / heads.
    assert plain_config_of(tmp_path, {**llama, "model_type": "gemma"}) is None
    # Mistral's class reads a null as one KV head per head, but a left-out value as 8.
    assert plain_config_of(tmp_path, {**llama, "model_type": "mistral", "num_key_value_heads": None}) is None
    without_vocab = {k: v for k, v in llama.items() if k != "vocab_size"}
    assert plain_config_of(tmp_path, without_vocab) is None  # the class's default, which only it knows
    assert plain_config_of(tmp_path, {**llama, "hidden_size": True}) is None
    assert plain_config_of(tmp_path, {**llama, "text_config": {}, "model_type": "llava"}) is None
    # Whatever the route, the shape read is transformers' own.
    (tmp_path / "config.json").write_text(json.dumps({**llama, "model_type": "gemma"}))
    assert config_values(load_config(tmp_path), tmp_path).head_dim == 256


def test_weights_that_do_not_match_their_config_are_refused_naming_the_tensors(saved, tmp_path):
    path, _ = saved
    config = json.loads((path / "config.json").read_text())
    for name, value in {"intermediate_size": 256, "num_hidden_layers": 3, "vocab_size": 64}.items():
        edited = tmp_path / name
        edited.mkdir()
        (edited / "model.safetensors").symlink_to(path / "model.safetensors")
        (edited / "config.json").write_text(json.dumps({**config, name: value}))
        with pytest.raises(ValueError, match=f"the weights in {edited} do not match its config.json: ") as refused:
            shape_from_model_dir(edited)
        said = str(refused.value)
        if name == "intermediate_size":
            assert "model.layers.*.mlp.up_proj.weight (2 layers) is [128, 64] in the weights, [256, 64]" in said
            assert said.count(" in the weights, ") == 3, said  # gate, up and down
        elif name == "num_hidden_layers":
            assert "num_hidden_layers is 3, the weights hold 2 layers" in said
        else:  # the tied head is not in the file: the embedding alone differs
            assert said.endswith("model.embed_tokens.weight is [128, 64] in the weights, [64, 64] by config.json")


@given(config=saved_configs())
@settings(max_examples=25, deadline=None)
def test_what_transformers_builds_from_a_common_config_is_what_the_check_expects(config):
    """No false refusal: the check's shapes are those of the model transformers builds (on the
    meta device: no storage), for every common type, with or without GQA, head_dim or tied heads."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from inference.model_size import config_mismatches

    small = {**config, "num_hidden_layers": min(config["num_hidden_layers"], 3), "vocab_size": 97}
    small["intermediate_size"] = min(small["intermediate_size"], 96)
    built = AutoConfig.for_model(small.pop("model_type"), **small)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(built)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}

    assert config_mismatches(config_values(built, Path(".")), shapes) == []


def plain_config_of(root: Path, config: dict[str, Any]):
    (root / "config.json").write_text(json.dumps(config))
    return plain_config(root)


def test_bad_directories_say_what_is_wrong(tmp_path, saved):
    with pytest.raises(ValueError, match=r"not a model directory: .* does not exist"):
        shape_from_model_dir(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"not a model directory: .* is not a directory"):
        shape_from_model_dir(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"no config.json in {tmp_path / 'empty'}")):
        shape_from_model_dir(tmp_path / "empty")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        shape_from_model_dir(broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="cannot read"):
        shape_from_model_dir(broken)

    path, _ = saved
    config = (path / "config.json").read_text()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(config)
    (corrupt / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        shape_from_model_dir(corrupt)

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "config.json").write_text(config)
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=re.escape("missing shards: model-00002-of-00002.safetensors")):
        shape_from_model_dir(shards)

    with pytest.raises(ValueError, match="unknown dtype"):
        shape_from_model_dir(path, "int4")
