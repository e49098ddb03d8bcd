"""Prefix caching: a prompt that begins as an earlier sequence's did shares its kept K/V blocks.

The pool's side (inference.kvpool: keep, find, take back the least recently used) against a model
of it; the batcher's side (inference.batching) on the tiny Llama the replicas serve, whose answers
with the cache must be those without it, token for token.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
import torch
from django.conf import settings as django_settings
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuportal.wire.prefix_cache import CACHE_SALT, salt_problem, scope
from gpuportal.wire.requestqueue import RequestQueue
from inference import paged
from inference.batching import Batcher, Sequence, eos_ids, run_until_idle
from inference.kvpool import BlockAccounting, BlockPool, PoolExhausted, chain, root
from inference.management.commands.make_tiny_model import write_tiny_model
from inference.paged import PagedModel, model_shape
from inference.serving import Server
from tests.support.serving import host_for

BT = 4  # tokens a block: small, so that short prompts span several blocks

SYSTEM = "You are a helpful assistant. Answer briefly and truthfully, in plain words. "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Any, Any]:
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-prefix"), size_mb=2, seed=3, log=lambda _: None).path
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def batcher(tiny: tuple[Any, Any], blocks: int = 64, *, prefix_cache: bool = True) -> Batcher:
    model, tokenizer = tiny
    pool = BlockPool.for_shape(model_shape(model, 0), blocks, dtype=torch.float32, device="cpu", block_tokens=BT)
    return Batcher(PagedModel(model, pool), tokenizer, eos_ids(model), prefix_cache=prefix_cache)


def answer(b: Batcher, prompt: list[int], max_tokens: int = 12, **fields: Any) -> Sequence:
    b.submit(seq := Sequence(prompt, max_tokens, **fields))
    run_until_idle(b)
    assert seq.error is None, seq.error
    return seq


def ids(tiny: tuple[Any, Any], text: str) -> list[int]:
    return tiny[1](text).input_ids


# -- the pool ----------------------------------------------------------------------------------------


def test_a_digest_names_every_token_before_it_and_its_adapter():
    a = chain(list(range(12)), BT, root(-1))
    b = chain([*range(4), 99, *range(5, 12)], BT, root(-1))
    assert len(a) == 3, "full blocks only: 12 tokens of 4"
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2], "a block after a change differs, its own tokens alike"
    assert chain(list(range(12)), BT, root(0)) != a, "another adapter's K/V: another chain"
    assert chain(list(range(11)), BT, root(-1)) == a[:2], "a partial block has no digest"


def test_a_scope_is_its_users_and_salts_alone():
    assert scope("alice") == scope("alice", None) == scope("alice", "")
    scopes = {scope("alice"), scope("bob"), scope("alice", "x"), scope("alicex"), scope("ab", "c"), scope("a", "bc")}
    assert len(scopes) == 6
    assert chain(list(range(8)), BT, root(-1, scope("alice"))) != chain(list(range(8)), BT, root(-1, scope("bob")))
    assert salt_problem(None) is None and salt_problem("tenant-7") is None
    assert salt_problem("") == salt_problem(7) == "must be a non-empty string"
    assert salt_problem("x" * 257) == "at most 256 characters"


def test_a_kept_block_is_found_by_a_prompts_beginning_and_shared():
    pool = BlockAccounting(8, block_tokens=BT)
    tokens = list(range(10))
    blocks = pool.allocate(3)
    pool.keep(chain(tokens, BT, root(-1)), blocks)  # two full blocks; the third is partial
    pool.free(blocks)
    assert (pool.blocks_used, pool.blocks_cached, pool.blocks_free) == (0, 2, 6)

    later = chain([*range(8), 50, 51, 52, 53], BT, root(-1))
    found = pool.cached(later)
    assert found == blocks[:2], "the first two blocks; the third's tokens differ"
    assert pool.available_besides(found) == 6, "once shared, the idle kept blocks are no longer free to take"
    pool.share(found)
    assert (pool.blocks_used, pool.blocks_cached) == (2, 0)
    pool.free(found)
    assert (pool.blocks_used, pool.blocks_cached) == (0, 2)


def test_an_allocation_takes_back_idle_kept_blocks_the_least_recently_used_first():
    pool = BlockAccounting(4, block_tokens=BT)
    old, new = pool.allocate(2), pool.allocate(2)
    pool.keep(chain(list(range(8)), BT, root(-1)), old)
    pool.keep(chain(list(range(100, 108)), BT, root(-1)), new)
    pool.free(old + new)
    assert pool.blocks_free == 0 and pool.blocks_available == 4

    taken = pool.allocate(1)
    assert taken == [old[1]], "the oldest run's tail goes first: its head is likelier to be shared"
    assert pool.cached(chain(list(range(8)), BT, root(-1))) == [old[0]]
    stats = pool.stats()
    assert (stats.blocks_used, stats.blocks_cached, stats.frees) == (1, 3, 1), "taking one back is a free"

    held = pool.cached(chain(list(range(100, 108)), BT, root(-1)))
    pool.share(held)  # a sequence holds the newer run: not to be taken back
    assert sorted(pool.allocate(1)) == [old[0]]
    with pytest.raises(PoolExhausted, match="need 1 KV blocks, 0 of 4 free"):
        pool.allocate(1)


def test_forgetting_frees_the_idle_kept_blocks_and_leaves_the_held_ones():
    pool = BlockAccounting(4, block_tokens=BT)
    idle, held = pool.allocate(1), pool.allocate(1)
    pool.keep(chain(list(range(4)), BT, root(-1)), idle)
    pool.keep(chain(list(range(4, 8)), BT, root(-1)), held)
    pool.free(idle)
    pool.forget()
    assert (pool.blocks_free, pool.blocks_used, pool.blocks_cached) == (3, 1, 0)
    assert pool.refcount(held[0]) == 1 and pool.cached(chain(list(range(4, 8)), BT, root(-1))) == []
    pool.free(held)
    assert pool.blocks_free == 4


class PrefixMachine(RuleBasedStateMachine):
    """Sequences allocate, keep and share prompts' blocks at random, under a pool too small for
    them all: the counts stay true and no block a sequence holds is ever handed to another."""

    TOTAL = 10

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockAccounting(self.TOTAL, block_tokens=BT)
        self.holding: list[list[int]] = []  # each live sequence's blocks

    @rule(words=st.lists(st.integers(0, 2), min_size=1, max_size=5), extra=st.integers(0, 3))
    def admit(self, words: list[int], extra: int) -> None:
        # Prompts drawn from few words, so that they often begin alike.
        tokens = [t for w in words for t in (w, w, w, w)]
        digests = chain(tokens, BT, root(-1))
        found = self.pool.cached(digests)
        need = len(words) + extra - len(found)
        if need > self.pool.available_besides(found):
            with pytest.raises(PoolExhausted):
                self.pool.share(found)
                self.pool.allocate(need)
            self.pool.free(found)  # undone: a batcher shares only what fits
            return
        self.pool.share(found)
        fresh = self.pool.allocate(need)
        held = {b for blocks in self.holding for b in blocks}
        assert not set(fresh) & held, "a block a sequence holds was handed out again"
        blocks = found + fresh
        self.pool.keep(digests, blocks[: len(digests)])
        self.holding.append(blocks)

    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        if self.holding:
            self.pool.free(self.holding.pop(data.draw(st.integers(0, len(self.holding) - 1))))

    @rule()
    def forget(self) -> None:
        self.pool.forget()

    @invariant()
    def counts_are_true(self) -> None:
        stats = self.pool.stats()
        held = {b for blocks in self.holding for b in blocks}
        assert stats.blocks_used == len(held), "used is what sequences hold"
        assert stats.blocks_used + stats.blocks_cached + stats.blocks_free == self.TOTAL
        assert stats.allocations - stats.frees == stats.blocks_used + stats.blocks_cached
        for block in held:
            holders = sum(blocks.count(block) for blocks in self.holding)
            assert self.pool.refcount(block) - holders in (0, 1), "each holder once, the cache at most once more"


PrefixMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestPrefixMachine = PrefixMachine.TestCase


# -- the batcher ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-pass-prefill", "chunked-prefill"])
def test_a_prompt_that_begins_as_an_earlier_one_reuses_its_blocks_and_answers_the_same(tiny, monkeypatch, chunk):
    if chunk is not None:  # what follows the kept blocks prefills in several passes, from their end
        monkeypatch.setattr(paged, "PREFILL_CHUNK_TOKENS", chunk)
    first, second = ids(tiny, SYSTEM + "What is a GPU?"), ids(tiny, SYSTEM + "Name a colour.")
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    b = batcher(tiny)
    assert answer(b, first).reused == 0, "nothing kept yet"
    again = answer(b, second)

    assert again.reused == common // BT * BT > 0, "every full block of the shared beginning, no more"
    assert again.result()["usage"]["prompt_tokens_details"] == {"cached_tokens": again.reused}
    assert again.generated == answer(batcher(tiny, prefix_cache=False), second).generated
    stats = b.pool.stats()
    assert (stats.prefix_queried, stats.prefix_hits) == (len(first) + len(second), again.reused)


def test_the_same_prompt_again_computes_only_its_last_block(tiny):
    prompt = ids(tiny, SYSTEM + "Count to three.")
    b = batcher(tiny)
    alone = answer(b, prompt).generated
    again = answer(b, prompt)
    # Its last token's logits must be computed, so its block is written again, not shared.
    assert again.reused == (len(prompt) - 1) // BT * BT
    assert again.generated == alone


def test_a_conversations_next_turn_reuses_the_answer_too(tiny):
    b = batcher(tiny)
    turn = answer(b, prompt := ids(tiny, SYSTEM + "Tell me a story."), max_tokens=20)
    follow = [*prompt, *turn.generated, *ids(tiny, "And then?")[1:]]
    following = answer(b, follow)
    assert following.reused > len(prompt) // BT * BT, "the answer's full blocks were kept as it ended"
    assert following.generated == answer(batcher(tiny, prefix_cache=False), follow).generated


def test_an_echoed_prompt_is_scored_whole_though_its_blocks_are_kept(tiny):
    prompt = ids(tiny, SYSTEM + "Score me.")
    fresh = answer(batcher(tiny), prompt, max_tokens=1, prompt_logprobs=0)
    b = batcher(tiny)
    answer(b, prompt)
    scored = answer(b, prompt, max_tokens=1, prompt_logprobs=0)
    assert scored.reused == 0 and len(scored.prompt_picked) == len(prompt) - 1
    assert [p[0] for p in scored.prompt_picked] == [p[0] for p in fresh.prompt_picked]
    assert [p[1] for p in scored.prompt_picked] == pytest.approx([p[1] for p in fresh.prompt_picked], abs=1e-4)


def test_another_adapters_sequence_shares_nothing_with_the_models(tiny):
    prompt = ids(tiny, SYSTEM + "Hello.")
    b = batcher(tiny)
    answer(b, prompt)
    # The engine here serves no adapter, so the answer is the model's: only the keying is tried.
    assert answer(b, prompt, adapter=0).reused == 0
    assert answer(b, prompt, adapter=0).reused > 0, "its own adapter's blocks, kept by the one before"


def test_another_users_sequence_shares_nothing_and_its_own_users_does(tiny):
    prompt = ids(tiny, SYSTEM + "A secret question.")
    b = batcher(tiny)
    answer(b, prompt, scope=scope("alice"))
    assert answer(b, prompt, scope=scope("bob")).reused == 0, "bob learns nothing of what alice asked"
    assert answer(b, prompt, scope=scope("alice", "end-user-9")).reused == 0, "nor alice's other salt"
    assert answer(b, prompt, scope=scope("alice")).reused > 0


def test_a_pool_full_of_kept_blocks_admits_what_an_empty_one_would(tiny):
    b = batcher(tiny, blocks=16)
    for text in ("One thing", "Two words more", "Three words here", "Four words right here"):
        answer(b, ids(tiny, text), max_tokens=4)
    assert b.pool.blocks_cached > 8 and b.pool.blocks_free < 8

    prompt = ids(tiny, "A prompt of its own.")
    whole = 16 * BT - len(prompt)  # the answer may fill the pool to its last token
    big = answer(b, prompt, max_tokens=whole)
    assert big.generated == answer(batcher(tiny, blocks=16, prefix_cache=False), prompt, max_tokens=whole).generated
    assert b.pool.blocks_used == 0


def test_sequences_running_together_share_a_prefix_kept_by_the_first_prefill(tiny):
    b = batcher(tiny)
    shared = ids(tiny, SYSTEM + "First.")
    b.submit(lead := Sequence(shared, 16))
    b.step()  # its prefill: its prompt's blocks kept while it decodes on
    b.submit(other := Sequence(ids(tiny, SYSTEM + "Second."), 16))
    run_until_idle(b)
    assert other.reused > 0 and lead.reused == 0
    assert other.blocks == [] and b.pool.blocks_used == 0, "all given back as they ended"


def test_a_prompt_sharing_idle_kept_blocks_waits_where_they_are_all_the_room_it_would_count(tiny):
    model, tokenizer = tiny
    pool = BlockPool.for_shape(model_shape(model, 0), 16, dtype=torch.float32, device="cpu", block_tokens=BT)
    # No end of text: every sequence runs to its max_tokens, each promised block taken.
    b = Batcher(PagedModel(model, pool), tokenizer, set())
    kept = list(range(1, 18))
    answer(b, kept, max_tokens=3)
    assert (pool.blocks_cached, pool.blocks_free) == (4, 12)
    b.submit(running := Sequence(list(range(100, 104)), 28))  # 8 blocks: 1 taken, 7 promised
    b.step()
    # 10 blocks, 4 of them the kept ones it shares: 6 more, where 15 - 4 shared - 7 promised = 4 remain.
    b.submit(sharing := Sequence([*kept, 50], 22))
    b.step()
    assert sharing in b.waiting, "the kept blocks it shares are no room for its other blocks"
    run_until_idle(b)
    assert len(running.generated) == 28 and len(sharing.generated) == 22 and sharing.reused == 16


def test_a_replicas_second_request_with_the_same_system_prompt_says_its_cached_tokens(tiny):
    model, tokenizer = tiny
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    rq, deployment = RequestQueue(client), f"d-{uuid.uuid4().hex[:8]}"
    host = host_for(model, tokenizer)
    server = Server(host, rq, deployment, poll_s=0.05)
    server.start()
    try:
        answers = []
        for question, owner, salt in (
            ("What is a GPU?", "u", None),
            ("What is a CPU?", "u", None),
            ("What is a CPU?", "v", None),  # another user: its own cache
            ("What is a CPU?", "u", "end-user-2"),  # the same user, another salt: likewise
        ):
            params = {"max_tokens": 6, **({CACHE_SALT: salt} if salt else {})}
            queued = rq.submit(deployment, kind="generate", input=SYSTEM + question, params=params, owner=owner)
            answers.append(rq.wait(queued.id, 60))
        stats = host.paged.pool.stats().as_event()  # the figures a replica publishes, before it stops
    finally:
        server.stopped.set()
        server.join(10)
        client.close()

    assert all(a is not None and a.status == "done" for a in answers), answers
    first, second, others, salted = (a.output["usage"] for a in answers)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    assert others["prompt_tokens_details"] == salted["prompt_tokens_details"] == {"cached_tokens": 0}
    assert stats["prefix_hits"] == second["prompt_tokens_details"]["cached_tokens"]
    assert stats["prefix_queried"] == sum(usage["prompt_tokens"] for usage in (first, second, others, salted))
    assert stats["blocks_cached"] > 0


# -- what the APIs say of it ---------------------------------------------------------------------

COUNTED = {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45}


def test_the_apis_usage_says_the_cached_tokens_in_each_ones_words():
    from scheduling.api.messages import usage
    from scheduling.api.openai_compat import _usage_of
    from scheduling.api.responses import _usage

    counted = {**COUNTED, "prompt_tokens_details": {"cached_tokens": 32}}
    assert _usage({"usage": counted}["usage"])["input_tokens_details"] == {"cached_tokens": 32}
    # Anthropic's input_tokens are those not read from its cache.
    said = usage({"usage": counted})
    assert (said["input_tokens"], said["cache_read_input_tokens"]) == (8, 32)
    # n choices of one prompt: its tokens once, as prompt_tokens counts them; another prompt's too.
    other = {**COUNTED, "prompt_tokens_details": {"cached_tokens": 16}}
    summed = _usage_of([{"usage": counted}, {"usage": counted}, {"usage": other}, {"usage": other}], 2)
    assert summed["prompt_tokens"] == 80 and summed["prompt_tokens_details"] == {"cached_tokens": 48}
    # A replica that says nothing of a cache (the generate() path): nothing cached, nothing said.
    assert "prompt_tokens_details" not in _usage_of([{"usage": COUNTED}, {"usage": COUNTED}], 1)
    assert usage({"usage": COUNTED})["cache_read_input_tokens"] == 0


def test_sequences_arriving_together_with_one_prompt_compute_it_once(tiny):
    # A request's n choices, or a burst of users of one system prompt: queued before the same step.
    prompt = ids(tiny, SYSTEM + "Same question.")
    b = batcher(tiny)
    for _ in range(3):
        b.submit(Sequence(prompt, 8))
    first = b.step()
    assert len(b.running) + len(first) == 1, "the first computes the prompt; the others wait a step for it"
    b.submit(other := Sequence(ids(tiny, "Another prompt altogether, long enough for a block."), 8))
    ended = run_until_idle(b)
    together = [s for s in ended if s.prompt == prompt]
    assert [s.reused for s in together] == [0, *[(len(prompt) - 1) // BT * BT] * 2]
    assert all(s.generated == together[0].generated for s in together) and other.error is None


def test_a_cache_salt_is_passed_on_to_the_replica_and_a_bad_one_refused_naming_it():
    from scheduling.api import completion_input
    from scheduling.api.responses import ResponsesView

    def parse(kind: completion_input.Kind, **body: Any) -> completion_input.Completion:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", **body}
        return completion_input.parse(body, kind, default_timeout_s=30, max_timeout_s=300)

    assert parse("chat", cache_salt="tenant-7").params[CACHE_SALT] == "tenant-7"
    assert parse("generate", cache_salt="tenant-7").params[CACHE_SALT] == "tenant-7"
    assert CACHE_SALT not in parse("chat").params
    responded = ResponsesView().parse({"model": "tiny", "input": "Hi", "cache_salt": "tenant-7"}, owner="1")
    assert responded.params[CACHE_SALT] == "tenant-7"
    for bad in ("", 7, "x" * 257):
        with pytest.raises(completion_input.Refused) as refused:
            parse("chat", cache_salt=bad)
        assert refused.value.param == CACHE_SALT


# -- the deployment's setting --------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("mode", ["shared", "off"])
def test_a_deployments_prefix_cache_setting_starts_its_replicas_with_it(mode):
    from inference.replica import parse_args
    from inference.supervisor import replica_argv
    from scheduling.services.replica_specs import spec_of
    from tests.support import factories as f

    node = f.node("node1")
    gpu = f.gpu(node, 0)
    replica = f.replica(f.deployment("tiny", prefix_cache=mode), node, gpu_mem_bytes_by_id={str(gpu.id): 2**30})
    spec = spec_of(replica, contexts=(0, 0), virtual=True)
    argv = replica_argv(spec, "python")

    assert spec.prefix_cache == mode and argv[argv.index("--prefix-cache") + 1] == mode
    assert parse_args(argv[argv.index("--replica-id") :]).prefix_cache == mode
    default = spec_of(f.replica(f.deployment("other"), node, gpu_mem_bytes_by_id={str(gpu.id): 2**30}))
    assert default.prefix_cache == "user" and "--prefix-cache" not in replica_argv(default, "python")


def test_a_replica_of_a_shared_cache_shares_across_users_and_one_of_none_keeps_nothing(tiny):
    model, tokenizer = tiny
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    rq = RequestQueue(client)
    cached: dict[str, list[int]] = {}
    try:
        for mode in ("shared", "off"):
            deployment = f"d-{uuid.uuid4().hex[:8]}"
            host = host_for(model, tokenizer, prefix_cache=mode)
            server = Server(host, rq, deployment, poll_s=0.05)
            server.start()
            try:
                for owner, salt in (("u", None), ("v", None), ("v", "end-user-2")):
                    params = {"max_tokens": 4, **({CACHE_SALT: salt} if salt else {})}
                    queued = rq.submit(deployment, kind="generate", input=SYSTEM + "Hi.", params=params, owner=owner)
                    answer = rq.wait(queued.id, 60)
                    assert answer is not None and answer.status == "done", answer
                    cached.setdefault(mode, []).append(answer.output["usage"]["prompt_tokens_details"]["cached_tokens"])
            finally:
                server.stopped.set()
                server.join(10)
            if mode == "off":
                assert host.paged.pool.stats().blocks_cached == 0
    finally:
        client.close()

    assert cached["shared"][0] == 0 and cached["shared"][1] > 0, "another user shares the first's prompt"
    assert cached["shared"][2] == 0, "a salt still keeps its requests to themselves"
    assert cached["off"] == [0, 0, 0]


def test_a_failed_forward_keeps_nothing_and_a_stopped_sequence_keeps_what_it_wrote(tiny, monkeypatch):
    b = batcher(tiny)
    prompt = ids(tiny, SYSTEM + "Fail me.")
    forward = b.engine.forward

    def failing(slices: Any) -> Any:
        raise RuntimeError("out of memory, say")

    monkeypatch.setattr(b.engine, "forward", failing)
    b.submit(failed := Sequence(prompt, 8))
    b.step()
    assert failed.error is not None and b.pool.blocks_cached == 0, "K/V half written is never shared"

    monkeypatch.setattr(b.engine, "forward", forward)
    b.submit(stopped := Sequence(prompt, 40))
    for _ in range(10):
        b.step()
    assert b.stop(lambda s: s is stopped) == [stopped]
    written = [*prompt, *stopped.generated][: stopped.cached]
    follow = answer(b, [*written, *ids(tiny, "Go on.")[1:]])
    assert follow.reused == len(written) // BT * BT > len(prompt) // BT * BT, "its answer's blocks too"


# -- at random --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> Any:
    """A random Llama of a few thousand parameters, in float64: prefills that start after kept
    blocks round as those that do not, so that its greedy answers may be compared exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval().double()


class NoText:
    """The small model has no tokenizer: its answers are compared by their ids."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


PREFIXES = ([], [7] * 9, [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(range(len(PREFIXES))),
            st.lists(st.integers(21, 49), min_size=1, max_size=8),
            st.integers(1, 10),  # max_tokens
            st.integers(0, 6),  # steps before it is submitted
        ),
        min_size=1,
        max_size=10,
    )
)
def test_at_random_the_cache_changes_no_answer_and_the_pool_counts_hold(small, requests):
    answers = []
    for cached in (True, False):
        shape = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 16}
        pool = BlockPool(12, **shape, dtype=torch.float64, device="cpu", block_tokens=BT)  # 48 tokens: short of room
        b = Batcher(PagedModel(small, pool), NoText(), set(), prefix_cache=cached)
        seqs = [Sequence([1, *PREFIXES[p], *suffix], n) for p, suffix, n, _ in requests]
        pending = list(zip(seqs, (wait for *_, wait in requests), strict=True))
        while pending or not b.idle:
            for seq in [s for s, w in pending if w <= 0]:
                b.submit(seq)
            pending = [(s, w - 1) for s, w in pending if w > 0]
            b.step()
            held = {block for s in b.running for block in s.blocks}
            stats = pool.stats()
            assert stats.blocks_used == len(held), "used is what the running sequences hold"
            assert stats.blocks_used + stats.blocks_cached + stats.blocks_free == pool.blocks_total
        assert all(s.error is None and len(s.generated) == s.max_tokens for s in seqs)
        answers.append([s.generated for s in seqs])
    with_cache, without = answers
    assert with_cache == without
