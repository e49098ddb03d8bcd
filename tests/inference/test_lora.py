"""LoRA adapters on the paged engine (inference.lora, inference.paged) against PEFT's own model.

A sequence's logits with its adapter must be PEFT's for that adapter, whatever the batch around
it (the base model, other adapters, chunked prefills); greedy answers through the batcher, those
of PEFT's merged model. Adapters PEFT saves that change more than B(A x) are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import LlamaForCausalLM

from gpuportal.wire.memory import dtype_bytes
from gpuportal.wire.sampling import Sampling
from inference import lora, paged
from inference.batching import Batcher, Sequence, run_until_idle
from inference.kvpool import BlockPool
from inference.lora import Adapters
from inference.paged import PagedModel, Slice, engine_for, model_shape
from tests.support.adapters import SQL, merged_greedy, write_adapter
from tests.support.serving import tiny_llama_config

# Two adapters as users train them: one on attention only, one on every projection of a higher
# rank with rsLoRA's scale (B random, not PEFT's zeros, so that each changes the answers).
ADAPTERS = {
    "sql": SQL,
    "chat": LoraConfig(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,
    ),
}


def base_model() -> Any:
    torch.manual_seed(11)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    model = base_model()
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_adapter(model, config, root / name, seed) for seed, (name, config) in enumerate(ADAPTERS.items())
    }


def peft_logits(adapter: Path | None, tokens: list[int]) -> torch.Tensor:
    """The last token's logits from PEFT's model with `adapter` (None: the base model alone)."""
    model = base_model()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def engine(adapters: dict[str, Path], blocks: int = 64) -> PagedModel:
    model = base_model()
    pool = BlockPool.for_shape(model_shape(model, 0), blocks, dtype=torch.float32, device="cpu", block_tokens=4)
    return PagedModel(model, pool, Adapters.read({name: str(path) for name, path in adapters.items()}))


PROMPTS = {None: [5, 17, 99, 3, 250, 41, 7], "sql": [8, 8, 120, 33, 2], "chat": [300, 12, 64, 64, 9, 401, 77, 18, 6]}


def test_each_sequence_gets_the_logits_of_its_own_adapter_in_one_mixed_batch(adapters):
    paged_model = engine(adapters)
    names = paged_model.adapters.names
    with torch.no_grad():
        slices = [
            Slice(tokens, 0, paged_model.pool.allocate(3), names.index(name) if name else -1)
            for name, tokens in PROMPTS.items()
        ]
        logits = paged_model.forward(slices)
    for row, (name, tokens) in enumerate(PROMPTS.items()):
        expected = peft_logits(adapters[name] if name else None, tokens)
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
    # And an adapter changes the answer: the same prompt's logits differ with and without it.
    tokens = PROMPTS["chat"]
    assert not torch.allclose(peft_logits(None, tokens), peft_logits(adapters["chat"], tokens), atol=1e-2)


def test_a_chunked_prefill_with_an_adapter_gives_the_logits_of_peft(adapters, monkeypatch):
    monkeypatch.setattr(paged, "PREFILL_CHUNK_TOKENS", 3)
    paged_model = engine(adapters)
    tokens = PROMPTS["chat"] * 2
    with torch.no_grad():
        logits = paged_model.forward(
            [Slice(tokens, 0, paged_model.pool.allocate(5), 1), Slice(PROMPTS[None], 0, paged_model.pool.allocate(2))]
        )
    torch.testing.assert_close(logits[0], peft_logits(adapters["chat"], tokens), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], peft_logits(None, PROMPTS[None]), atol=1e-4, rtol=1e-4)


class _NoText:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def test_the_batcher_answers_each_adapter_as_peft_s_merged_model_does(adapters):
    paged_model = engine(adapters, blocks=64)
    batch = Batcher(paged_model, _NoText(), set())
    sequences = {
        name: Sequence(list(PROMPTS[name]), 12, sampling=Sampling(), adapter=paged_model.adapters.index(name))
        for name in ("sql", "chat")
    }
    with torch.no_grad():
        for seq in sequences.values():
            batch.submit(seq)
        run_until_idle(batch)
    for name, seq in sequences.items():
        assert seq.generated == merged_greedy(base_model(), adapters[name], PROMPTS[name], 12), name


def test_the_stacks_take_the_bytes_the_deploy_counted(adapters):
    read = Adapters.read({name: str(path) for name, path in adapters.items()})
    paged_model = engine(adapters)
    held = sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size() for s in paged_model.lora.values())
    counted = lora.reading_bytes({name: str(path) for name, path in adapters.items()}, "float32")
    assert counted == read.nbytes("float32") >= held > 0
    # 2 layers x (4 attention + 3 MLP projections), two adapters each, rank 8, float32.
    assert held == sum(2 * 8 * (fan_in + fan_out) * 4 for fan_in, fan_out in _projections()) * 2


def _projections() -> list[tuple[int, int]]:
    hidden, inner, kv = 64, 128, 2 * 16
    attention = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]
    return [*attention, (hidden, inner), (hidden, inner), (inner, hidden)]


def test_the_pool_is_sized_after_the_adapters(adapters):
    model = base_model()
    read = Adapters.read({name: str(path) for name, path in adapters.items()})
    cap = 256 * 1024**2
    without = engine_for(model, weights_bytes=8 * 1024**2, cap_bytes=cap, max_tokens=1024, context_bytes=0)
    added = engine_for(
        base_model(),
        weights_bytes=8 * 1024**2 + read.nbytes("float32"),
        cap_bytes=cap,
        max_tokens=1024,
        context_bytes=0,
        adapters=read,
    )
    assert added.pool.blocks_total < without.pool.blocks_total
    assert added.adapters is read and dtype_bytes("float32") == 4


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias 'all'"),
        ({"peft_type": "IA3"}, "'IA3'"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ],
)
def test_an_adapter_that_changes_more_than_its_lora_is_refused_by_name(adapters, tmp_path, change, named):
    bent = tmp_path / "bent"
    bent.mkdir()
    config = json.loads((adapters["sql"] / lora.CONFIG).read_text())
    (bent / lora.CONFIG).write_text(json.dumps({**config, **change}))
    (bent / lora.WEIGHTS).write_bytes((adapters["sql"] / lora.WEIGHTS).read_bytes())
    with pytest.raises(ValueError, match=named) as refused:
        lora.reading_bytes({"bent": str(bent)}, "float32")
    assert "adapter 'bent'" in str(refused.value)


def test_an_adapter_of_another_model_is_refused_naming_the_projection(tmp_path):
    config = tiny_llama_config()
    config.hidden_size, config.intermediate_size = 32, 64
    torch.manual_seed(0)
    other = write_adapter(LlamaForCausalLM(config), ADAPTERS["sql"], tmp_path / "other", 0)
    with pytest.raises(ValueError, match=r"adapter 'other': layer 0's q_proj is \[64 x 32\] in the adapter"):
        engine({"other": other})


def test_a_directory_without_an_adapter_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"adapter 'x': .* has no adapter_config.json"):
        lora.reading_bytes({"x": str(tmp_path)}, "float32")
    with pytest.raises(ValueError, match="no adapter 'nope' \\(its adapters: sql\\)"):
        Adapters([lora.Adapter("sql", "", 1.0, False, {})]).index("nope")
