"""Paged, continuously batched generation against transformers' own generate().

Greedy outputs must be token for token those of model.generate(do_sample=False) with its default
cache, whatever the batch around a sequence: alone, all at once, or joining mid-way. In-process:
no replica, no queue (tests/inference/test_serving.py covers the Server end to end).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire.memory import activation_reserve_bytes, estimate, kv_block_bytes
from gpuportal.wire.sampling import Sampling
from inference import paged
from inference.batching import Batcher, Sequence, eos_ids, run_until_idle
from inference.errors import BadInput
from inference.kvpool import BlockPool
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.paged import PagedModel, Slice, engine_for, model_shape, unsupported_reason

PROMPTS = [
    "Hello",
    "Once upon a time there was a small model",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "GPU",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    """The Llama model and tokenizer that replicas serve in the end-to-end tests."""
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-paged"), size_mb=2, seed=3, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


class _NoText:
    """A tokenizer stand-in for models built here without one: token ids are all the tests compare."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def random_model(kind: str) -> Any:
    """A small randomly initialised model of another Llama-style architecture, with GQA."""
    from transformers import AutoConfig

    torch.manual_seed(1)
    config = AutoConfig.for_model(
        kind,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        sliding_window=None,  # Mistral's default 4096-token window is not paged (falls back)
    )
    return AutoModelForCausalLM.from_config(config).eval()


def reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def batcher(model: Any, tokenizer: Any, blocks: int, block_tokens: int = 4) -> Batcher:
    shape = model_shape(model, 0)
    pool = BlockPool.for_shape(shape, blocks, dtype=torch.float32, device="cpu", block_tokens=block_tokens)
    return Batcher(PagedModel(model, pool), tokenizer, eos_ids(model))


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-pass-prefill", "chunked-prefill"])
def test_greedy_outputs_equal_generate_alone_together_and_joining_mid_way(tiny, monkeypatch, chunk):
    model, tokenizer = tiny
    if chunk is not None:  # prompts longer than a chunk: prefill in several passes
        monkeypatch.setattr(paged, "PREFILL_CHUNK_TOKENS", chunk)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    assert chunk is None or max(len(p) for p in prompts) > 2 * chunk
    lengths = [24, 9, 17, 30, 12]
    expected = [reference(model, p, n) for p, n in zip(prompts, lengths, strict=True)]

    alone = []
    for p, n in zip(prompts, lengths, strict=True):
        b = batcher(model, tokenizer, blocks=64)
        b.submit(seq := Sequence(p, n))
        run_until_idle(b)
        alone.append(seq.generated)
    assert alone == expected

    together = batcher(model, tokenizer, blocks=64)
    seqs = [Sequence(p, n) for p, n in zip(prompts, lengths, strict=True)]
    for s in seqs:
        together.submit(s)
    run_until_idle(together)
    assert [s.generated for s in seqs] == expected

    # Joining mid-way: one more sequence every 3 steps, while the earlier ones decode.
    staggered = batcher(model, tokenizer, blocks=64)
    seqs = [Sequence(p, n) for p, n in zip(prompts, lengths, strict=True)]
    for s in seqs:
        staggered.submit(s)
        for _ in range(3):
            staggered.step()
    run_until_idle(staggered)
    assert [s.generated for s in seqs] == expected
    stats = staggered.pool.stats()
    assert stats.blocks_used == 0 and stats.allocations == stats.frees + stats.blocks_cached, "each block freed or kept"


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_other_llama_style_architectures_with_grouped_query_attention(kind, monkeypatch):
    monkeypatch.setattr(paged, "PREFILL_CHUNK_TOKENS", 4)  # the 7- and 13-token prompts prefill in chunks
    model = random_model(kind)
    assert unsupported_reason(model) is None
    prompts = [[5, 17, 42, 9, 100, 3, 77], [8], [250, 251, 252, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    expected = [reference(model, p, 12) for p in prompts]
    b = batcher(model, _NoText(), blocks=32)
    seqs = [Sequence(p, 12) for p in prompts]
    b.submit(seqs[0])
    b.step()
    b.submit(seqs[1])
    b.submit(seqs[2])
    run_until_idle(b)
    assert [s.generated for s in seqs] == expected


def prefill(model: Any, chunk: int, monkeypatch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two slices of different lengths and starts (one after a cached prefix) through a fresh pool,
    with prefill chunks of `chunk` tokens: the logits, and the pool's K and V."""
    monkeypatch.setattr(paged, "PREFILL_CHUNK_TOKENS", chunk)
    torch.manual_seed(7)
    vocab = model.config.vocab_size
    prefix, first, second = (torch.randint(0, vocab, (n,)).tolist() for n in (11, 37, 23))
    pool = BlockPool.for_shape(model_shape(model, 0), 32, dtype=torch.float32, device="cpu", block_tokens=4)
    blocks = pool.allocate(32)  # all of them, zeroed
    a_blocks, b_blocks = blocks[20:8:-1], [blocks[i] for i in (3, 30, 5, 1, 7, 2, 31, 6, 4)]  # 48, 36 tokens
    engine = PagedModel(model, pool)
    with torch.no_grad():
        engine.forward([Slice(prefix, 0, b_blocks)])  # the second slice continues after 11 cached tokens
        logits = engine.forward([Slice(first, 0, a_blocks), Slice(second, len(prefix), b_blocks)])
    return logits, pool.k.clone(), pool.v.clone()


def test_a_chunked_prefill_gives_the_logits_and_kv_of_one_pass(tiny, monkeypatch):
    model, _ = tiny
    whole_logits, whole_k, whole_v = prefill(model, 10**9, monkeypatch)
    chunked_logits, chunked_k, chunked_v = prefill(model, 5, monkeypatch)
    assert whole_logits.shape == (2, model.config.vocab_size) and whole_logits.dtype == torch.float32
    torch.testing.assert_close(chunked_logits, whole_logits)
    torch.testing.assert_close(chunked_k, whole_k)
    torch.testing.assert_close(chunked_v, whole_v)
    assert whole_k.abs().sum() > 0 and whole_v.abs().sum() > 0, "the prefill wrote into the pool"


def test_a_chunked_prefill_checks_every_slices_blocks_before_writing_any(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setattr(paged, "PREFILL_CHUNK_TOKENS", 5)
    pool = BlockPool.for_shape(model_shape(model, 0), 8, dtype=torch.float32, device="cpu", block_tokens=4)
    engine = PagedModel(model, pool)
    fits, short = pool.allocate(5), pool.allocate(2)
    with pytest.raises(ValueError, match="blocks for 8 tokens, the slice needs 12"), torch.no_grad():
        engine.forward([Slice([1] * 20, 0, fits), Slice([1] * 12, 0, short)])
    taken = torch.tensor(fits + short)
    assert pool.k[:, taken].abs().sum() == 0 and pool.v[:, taken].abs().sum() == 0, "not even the first chunk"


def test_a_small_pool_makes_requests_wait_in_order_and_all_complete(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer(p).input_ids for p in PROMPTS] * 2
    expected = [reference(model, p, 10) for p in prompts]
    b = batcher(model, tokenizer, blocks=12, block_tokens=4)  # 48 tokens: two or three at a time
    seqs = [Sequence(p, 10) for p in prompts]
    for s in seqs:
        b.submit(s)
    waited = 0
    while not b.idle:
        b.step()
        waited = max(waited, len(b.waiting))
        assert len(b.running) <= 3 and b.pool.blocks_used <= b.pool.blocks_total
    assert [s.generated for s in seqs] == expected
    assert all(s.finish == "length" for s in seqs) and waited >= len(seqs) - 3
    stats = b.pool.stats()
    assert stats.blocks_used == 0 and 0 < stats.blocks_peak <= stats.blocks_total
    assert len(seqs) * 3 > stats.blocks_total, "the test must oversubscribe the pool"


def test_admission_is_fifo_and_reserves_prompt_plus_max_tokens(tiny):
    model, tokenizer = tiny
    b = batcher(model, tokenizer, blocks=9, block_tokens=4)
    big = Sequence([1] * 8, 24)  # 32 tokens: 8 blocks
    small_then = Sequence([1] * 2, 2)  # 1 block, but behind one that does not fit yet
    first = Sequence([1] * 4, 4)  # 2 blocks
    for s in (first, big, small_then):
        b.submit(s)
    b.step()
    assert b.running == [first] and list(b.waiting) == [big, small_then], "nobody overtakes the head"
    assert b.pool.blocks_used == 1, "the prompt's block only; the second was promised for growth"
    run_until_idle(b)
    assert first.finish and big.finish and small_then.finish


def test_a_request_that_can_never_fit_is_bad_input_naming_the_kv_capacity(tiny):
    model, tokenizer = tiny
    b = batcher(model, tokenizer, blocks=5, block_tokens=4)
    with pytest.raises(BadInput, match=r"KV capacity is 20 tokens \(5 blocks\)"):
        b.submit(Sequence([1] * 10, 11))
    b.submit(Sequence([1] * 10, 10))  # exactly 20 tokens fits
    assert run_until_idle(b)[0].finish == "length"
    with pytest.raises(BadInput, match="input too long: 2000 prompt tokens plus max_tokens 100 exceed"):
        batcher(model, tokenizer, blocks=1000).submit(Sequence([1] * 2000, 100))


def test_a_chat_that_asked_for_no_length_runs_as_far_as_the_replica_has_room_beside_its_prompt(tiny):
    from gpuportal.wire.sampling import DEFAULT_CHAT_MAX_TOKENS

    model, tokenizer = tiny
    b = batcher(model, tokenizer, blocks=5, block_tokens=4)  # 20 tokens in all
    fitting = Sequence([1] * 6, DEFAULT_CHAT_MAX_TOKENS, fit=True)
    crowded = Sequence([1] * 14, DEFAULT_CHAT_MAX_TOKENS, fit=True)

    b.submit(fitting)
    b.submit(crowded)

    assert fitting.max_tokens == 10, "half the cache at most, not the default: room for another beside it"
    assert (crowded.max_tokens, crowded.tokens_needed) == (6, 20), "the room beside a long prompt"
    with pytest.raises(BadInput, match="KV capacity is 20 tokens"):
        b.submit(Sequence([1] * 20, DEFAULT_CHAT_MAX_TOKENS, fit=True))  # no room at all: too long, as asked
    roomy = Sequence([1] * 6, DEFAULT_CHAT_MAX_TOKENS, fit=True)
    batcher(model, tokenizer, blocks=1000).submit(roomy)
    assert roomy.max_tokens == DEFAULT_CHAT_MAX_TOKENS, "where there is room: the default"


def test_abort_returns_every_block_newest_first(tiny):
    model, tokenizer = tiny
    b = batcher(model, tokenizer, blocks=18, block_tokens=4)  # room for the first two (9 + 8 blocks)
    seqs = [Sequence([1, 2, 3], 30), Sequence([4, 5], 30), Sequence([6], 30)]
    for s in seqs:
        b.submit(s)
    for _ in range(5):
        b.step()
    assert b.pool.blocks_used > 0 and len(b.running) == 2 and len(b.waiting) == 1
    assert b.abort_all() == seqs[::-1]
    assert b.idle and b.pool.blocks_used == 0
    stats = b.pool.stats()
    assert stats.allocations == stats.frees > 0


def test_stop_strings_eos_streaming_and_sampling(tiny):
    model, tokenizer = tiny
    prompt = tokenizer("Once upon a time").input_ids
    greedy = tokenizer.decode(reference(model, prompt, 20), skip_special_tokens=True)
    chunks: list[str] = []
    b = batcher(model, tokenizer, blocks=64)
    b.submit(streamed := Sequence(prompt, 20, on_chunk=chunks.append))
    run_until_idle(b)
    assert "".join(chunks) == streamed.text == greedy
    assert streamed.result()["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 20,
        "total_tokens": len(prompt) + 20,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    stop = greedy.strip()[3:6]
    b.submit(cut := Sequence(prompt, 20, stop=[stop]))
    run_until_idle(b)
    assert cut.finish == "stop" and cut.text == greedy[: greedy.find(stop)]
    assert cut.result()["stop_reason"] == stop, "the output says which stop string ended it"
    assert "stop_reason" not in streamed.result(), "an answer that ran to its length ended on no stop"

    b.eos = {reference(model, prompt, 3)[2]}  # the third greedy token ends the sequence
    b.submit(ends := Sequence(prompt, 20))
    run_until_idle(b)
    assert ends.finish == "stop" and len(ends.generated) == 3
    assert "stop_reason" not in ends.result(), "the end of text is no stop the caller gave"

    b.eos = set()
    b.generator = torch.Generator().manual_seed(0)
    b.submit(sampled := Sequence(prompt, 8, sampling=Sampling(temperature=0.9, top_p=0.8)))
    run_until_idle(b)
    assert len(sampled.generated) == 8 and all(0 <= t < model.config.vocab_size for t in sampled.generated)
    assert b.pool.blocks_used == 0


def test_the_pool_takes_what_the_cap_leaves_by_the_schedulers_formula(tiny):
    model, _ = tiny
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = model_shape(model, weights)
    planned = estimate(shape, max_tokens=256, cuda_context_bytes=0)

    engine = engine_for(model, weights_bytes=weights, cap_bytes=planned.total_bytes, max_tokens=256, context_bytes=0)

    assert engine.pool.blocks_total == planned.kv_blocks
    assert engine.pool.tensor_bytes == planned.kv_bytes == planned.kv_blocks * kv_block_bytes(shape)
    small = engine_for(
        model,
        weights_bytes=weights,
        cap_bytes=weights + activation_reserve_bytes(shape, 256) + kv_block_bytes(shape) - 1,
        max_tokens=256,
        context_bytes=0,
    )
    assert small.pool.blocks_total == 0
    engine.pool.release()
    assert engine.pool.tensor_bytes == 0


def test_a_streamed_piece_never_ends_inside_a_character_and_the_pieces_add_up_to_the_text():
    from inference.stream_text import newly_settled

    # What decoding a byte-level tokenizer's tokens so far gives, one token at a time: "é" is two
    # bytes, and the token holding the first shows as U+FFFD until the second arrives.
    decodes = ["Caf", "Caf\ufffd", "Café", "Café \ufffd"]
    sent, pieces = "", []
    for index, text in enumerate(decodes):
        piece = newly_settled(text, sent, final=index == len(decodes) - 1)
        pieces.append(piece)
        sent += piece

    assert pieces == ["Caf", "", "é", " \ufffd"], "held back, then sent whole; the last one as the answer has it"
    assert sent == decodes[-1]
    assert newly_settled("Cab", "Caf") == "", "a tail that changed under what was sent sends nothing"


def test_text_decoded_a_token_at_a_time_is_the_whole_decode_of_the_same_tokens(tiny):
    import random

    from inference.stream_text import REPLACEMENT, IncrementalText

    _, tokenizer = tiny
    rng = random.Random(4)
    for _ in range(40):
        # Any ids at all: byte tokens that split characters, special tokens, merges.
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        text = IncrementalText(tokenizer)
        for end in range(1, len(ids) + 1):
            so_far = text.update(ids[:end])
            whole = tokenizer.decode(ids[:end], skip_special_tokens=True)
            assert whole.startswith(so_far), (ids[:end], so_far, whole)
            if not whole.endswith(REPLACEMENT):
                assert so_far == whole, (ids[:end], so_far, whole)
