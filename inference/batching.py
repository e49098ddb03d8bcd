"""Continuous batching over the KV block pool.

Sequences wait in FIFO order; between steps the head of the line joins the running batch when the
pool can hold it; every step runs one prefill forward for the sequences that just joined and one
decode forward for all the others, then finished sequences leave and give their blocks back.

Admission policy (never deadlocks, never runs out of blocks): a sequence is admitted only when
the free blocks, less those promised to running sequences, cover its prompt plus max_tokens. It
takes the prompt's blocks at once and one more block each time it crosses a block boundary; those
later blocks were promised at admission, so growth never fails and nothing is ever preempted. The
head of the line is never overtaken (no starvation of long requests), but by those behind a
sequence held to a format whose parser is still being prepared (inference.constrained): that one
holds no blocks and waits in its place, and the others go by it. The cost is that a sequence
stopping early (EOS, a stop string) kept room it did not use until it ends; concurrency therefore
follows the requests' max_tokens, not the model's context length.

Prefix caching (inference.kvpool): a sequence admitted shares the kept blocks of its prompt's
longest cached beginning and its prefill starts after them, so a system prompt, a conversation's
history or an agent's tools are computed once, not at every request. Every sequence that ends
leaves its full blocks kept (its answer's too: the next turn of its chat begins with them). A
prompt scored (echo with log probabilities) computes every token, as it must, and keeps them after.

Driven by one thread (the replica's Server, a test, a benchmark); the pool itself is thread-safe
so other threads may read its statistics.
"""

from __future__ import annotations

import array
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuportal.wire.memory import kv_blocks
from gpuportal.wire.reasoning import counted, past_budget
from gpuportal.wire.requestqueue import STOPPED, picked_piece
from gpuportal.wire.sampling import STOP_REASON, Sampling, first_stop, fitted_max_tokens
from inference.errors import TooLong
from inference.kvpool import BlockPool, chain, root
from inference.paged import PagedModel, Slice
from inference.stream_text import IncrementalText, newly_settled
from inference.token_logprobs import Picked, entries, of_rows, prompt_entries

# How long a driver with nothing to run waits for a format being prepared before it looks again
# (for new requests, for asks to stop): short beside the second a format's first preparation takes.
FORMAT_WAIT_S = 0.05


class Format(Protocol):
    """What an answer is held to (inference.constrained.Held): the ids its next token may be,
    given its tokens so far. It may not be ready yet (the parser's view of the tokenizer is being
    built): the sequence then waits, and those behind it in line may go first."""

    def __call__(self, answer: list[int]) -> list[int]: ...

    def ready(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


@dataclass
class Sequence:
    """One generation: its prompt, its limits, and (once admitted) its blocks and tokens."""

    prompt: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    on_chunk: Callable[[str], None] | None = None
    # How each next token is chosen (gpuportal.wire.sampling): greedy unless told otherwise.
    sampling: Sampling = field(default_factory=Sampling)
    # Whatever the driver needs to find its request again (the Server keeps the Request here).
    tag: Any = None
    # Held to a format (inference.constrained): the ids its next token may be, given its answer
    # so far; None: any.
    allowed: Format | None = None
    # max_tokens is the most the request may have, to be fitted to the room the batcher has (a
    # chat that asked for no exact length: gpuportal.wire.sampling.fitted_max_tokens) as it is checked.
    fit: bool = False
    # Asked for its tokens' log probabilities, with this many alternatives each (None: not asked;
    # inference.token_logprobs); what each generated token's were, as it was picked.
    logprobs: int | None = None
    picked: list[Picked] = field(default_factory=list)
    logprob_entries: list[dict[str, Any]] = field(default_factory=list)  # as its result gives them
    # An echoed prompt's tokens scored too, with this many alternatives each (OpenAI's `echo` beside
    # `logprobs`: what an eval harness reads a prompt's likelihood from); None: not asked.
    prompt_logprobs: int | None = None
    prompt_picked: list[Picked] = field(default_factory=list)
    prompt_entries: list[dict[str, Any]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose K/V are in the blocks
    # Of the prompt's tokens, those whose K/V came from the prefix cache (OpenAI's
    # `prompt_tokens_details.cached_tokens`).
    reused: int = 0
    promised: int = 0  # blocks reserved at admission, not taken yet
    finish: str | None = None  # "stop" | "length" once done; STOPPED where its caller asked it stopped
    # The stop string it ended on, or the stop token's id (gpuportal.wire.sampling.STOP_REASON).
    stop_reason: str | int | None = None
    # When its first token was sampled (time.time()): the request's time to first token.
    first_token_at: float | None = None
    text: str = ""
    # What of a chat's prompt opened the answer's thinking (gpuportal.wire.reasoning.opened_by):
    # its text, streamed and whole, begins with it, as the model's turn reads.
    opened: str = ""
    # Its model's `</think>` token (gpuportal.wire.reasoning.closing_id): its usage counts the
    # tokens of its thinking. None: the model has none.
    close_id: int | None = None
    # Its model's `<think>` token, which begins an answer whose model opens its own thinking.
    open_id: int | None = None
    # The most tokens its thinking may have (gpuportal.wire.reasoning.THINKING_BUDGET): at it, its
    # next token is `close_id`. None: unbounded.
    thinking_budget: int | None = None
    # Its LoRA adapter's row in the engine's stacks (inference.lora); -1: the base model.
    adapter: int = -1
    # Whose kept K/V blocks it may share (gpuportal.wire.prefix_cache.scope): those of its scope only.
    scope: bytes = b""
    error: Exception | None = None
    _sent: str = ""
    _streamed_picks: int = 0  # of `picked`, those whose log probabilities went out with a piece
    _decoded: IncrementalText | None = None  # the text so far, for streaming and stop strings
    _generator: Any = None  # a seeded request's own torch.Generator, made at its first sample
    # Its format's last list of ids for its next token, and that list as a mask on the device.
    _allowed_mask: tuple[list[int], Any] | None = None
    _thinking_closed: bool = False  # its answer has generated `close_id` (with a budget to hold)
    _digests: list[bytes] = field(default_factory=list)  # its prompt's full blocks' (inference.kvpool.chain)

    @property
    def tokens_needed(self) -> int:
        return len(self.prompt) + self.max_tokens

    def result(self) -> dict[str, Any]:
        """The request's output, shaped like Executor.generate's."""
        prompt, completion = len(self.prompt), len(self.generated)
        output: dict[str, Any] = {
            "text": self.opened + self.text,
            "finish_reason": self.finish,
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.reused},
            },
        }
        counted(output, self.generated, self.close_id)
        if self.stop_reason is not None:
            output[STOP_REASON] = self.stop_reason
        if self.logprobs is not None:
            output["logprobs"] = self.logprob_entries
        if self.prompt_logprobs is not None:
            output["prompt_logprobs"] = self.prompt_entries
        return output


class Batcher:
    """Admits, steps and retires sequences on one PagedModel (one pool)."""

    def __init__(
        self,
        engine: PagedModel,
        tokenizer: Any,
        eos_token_ids: set[int],
        generator: Any | None = None,
        on_start: Callable[[Sequence], None] | None = None,
        *,
        prefix_cache: bool = True,
    ):
        self.engine = engine
        self.pool: BlockPool = engine.pool
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.generator = generator  # torch.Generator for sampling; None: torch's global one
        self.on_start = on_start  # told when a sequence is admitted (the request starts running)
        # Whether prompts reuse the K/V kept from earlier sequences (off: each computes its own, as
        # a benchmark's side by side compares).
        self.prefix_cache = prefix_cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    @property
    def capacity_tokens(self) -> int:
        return self.pool.blocks_total * self.pool.block_tokens

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def runnable(self) -> bool:
        """Whether a step would run something: a sequence running, or one that may be admitted."""
        return bool(self.running) or self.backlog

    @property
    def backlog(self) -> bool:
        """Whether a sequence waits for room (not only for its format to be ready)."""
        return any(_ready(s) for s in self.waiting)

    def wait_for_formats(self, timeout: float = FORMAT_WAIT_S) -> None:
        """Where nothing can run but sequences wait for their formats, wait (at most `timeout`
        seconds) for one of those to be ready, rather than step for nothing: a driver's loop
        would take the GIL from the thread building the format."""
        if self.runnable or not self.waiting:
            return
        first = self.waiting[0].allowed
        if first is not None:
            first.wait(timeout)

    def check(self, seq: Sequence) -> None:
        """BadInput if `seq` could never run here, however long it waited."""
        context = self.engine.context
        if seq.fit:
            # Its max_tokens so far is the most it may have (gpuportal.wire.sampling.max_tokens_bound).
            fitted = fitted_max_tokens(len(seq.prompt), context, self.capacity_tokens, most=seq.max_tokens)
            seq.max_tokens, seq.fit = fitted, False
        if context is not None and seq.tokens_needed > context:
            raise TooLong(
                f"input too long: {len(seq.prompt)} prompt tokens plus max_tokens {seq.max_tokens} exceed "
                f"the model's context of {context} tokens"
            )
        blocks = kv_blocks(seq.tokens_needed, self.pool.block_tokens)
        if blocks > self.pool.blocks_total:
            raise TooLong(
                f"input too long for this replica's KV cache: {len(seq.prompt)} prompt tokens plus max_tokens "
                f"{seq.max_tokens} need {blocks} blocks of {self.pool.block_tokens} tokens; the replica's KV "
                f"capacity is {self.capacity_tokens} tokens ({self.pool.blocks_total} blocks)"
            )

    def has_room(self) -> bool:
        """Whether every waiting sequence would be admitted at the next step with blocks to spare:
        a driver may then hand over another one (which may still have to wait)."""
        bt = self.pool.block_tokens
        wanted = sum(kv_blocks(s.tokens_needed, bt) for s in self.waiting)
        return wanted < self.pool.blocks_available - self._promised()

    def submit(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def step(self) -> list[Sequence]:
        """Admit what fits, run one prefill and one decode forward; returns the sequences that ended
        (finish set, or error set if their forward failed). Their blocks are already free."""
        joined = self._admit()
        decoding = [s for s in self.running if s not in joined]
        ended: list[Sequence] = []
        for group, slices in (
            (joined, [Slice(s.prompt[s.cached :], s.cached, s.blocks, s.adapter) for s in joined]),
            (decoding, None),
        ):
            if not group:
                continue
            if slices is None:
                for s in group:
                    self._grow(s)
                slices = [Slice([s.generated[-1]], s.cached, s.blocks, s.adapter) for s in group]
            try:
                logits = self._forward(slices, group)
            except Exception as exc:  # a bad forward fails its sequences, not the replica
                for s in group:
                    s.error = exc
                    ended.append(s)
                continue
            for s, sl, token in zip(group, slices, self._sample_all(group, logits), strict=True):
                s.cached += len(sl.tokens)
                if group is joined:  # its prompt's K/V written: the sequences that follow may share it
                    self._keep(s)
                if s.error is not None:  # its format failed as its next token was chosen
                    ended.append(s)
                    continue
                self._append(s, token)
                if s.finish is not None:
                    ended.append(s)
        for s in ended:
            self._retire(s)
        return ended

    def abort_all(self) -> list[Sequence]:
        """End every sequence now (a drain past its deadline), blocks freed; newest first, so that
        giving each back to the head of its queue leaves the oldest at the head."""
        everyone = [*self.running, *self.waiting]
        for s in self.running:
            self._release(s)
        self.running.clear()
        self.waiting.clear()
        return everyone[::-1]

    def stop(self, asked: Callable[[Sequence], bool]) -> list[Sequence]:
        """End the sequences `asked` names now, running or waiting (their callers asked them
        stopped): finish STOPPED, their text what they generated until now, their blocks free. The
        others go on, at their next step, as if nothing had happened."""
        ended = [s for s in (*self.running, *self.waiting) if asked(s)]
        for s in ended:
            if s in self.waiting:
                self.waiting.remove(s)
            self._retire(s)
            s.finish = STOPPED
            s.text = self.tokenizer.decode(s.generated, skip_special_tokens=True)
            self._keep_logprobs(s)
        return ended

    def take_waiting(self) -> list[Sequence]:
        """The sequences not admitted yet (nothing of theirs ran), newest first; they leave the line."""
        waiting = list(self.waiting)[::-1]
        self.waiting.clear()
        return waiting

    # -- internals ---------------------------------------------------------------------------------

    def _promised(self) -> int:
        return sum(s.promised for s in self.running)

    def _admit(self) -> list[Sequence]:
        joined: list[Sequence] = []
        bt = self.pool.block_tokens
        computing: set[bytes] = set()  # the prompt blocks this step's prefills will write and keep
        for head in list(self.waiting):
            if not _ready(head):
                # Its format's view of the tokenizer is being built: it holds no blocks yet, and
                # those behind it go by rather than wait the second that takes.
                continue
            reused = self._cached(head)
            shareable = (len(head.prompt) - 1) // bt if head.prompt_logprobs is None else 0
            if computing and len(reused) < shareable and head._digests[len(reused)] in computing:
                # Its next block is one a sequence joining now computes (a burst sharing a system
                # prompt, a request's n choices): it waits this step out and shares it, rather
                # than compute it again beside it. Those behind it wait with it (FIFO).
                break
            need = kv_blocks(head.tokens_needed, bt) - len(reused)
            if need > self.pool.available_besides(reused) - self._promised():
                break  # strict FIFO among the ready: the head waits, and nobody overtakes it
            self.waiting.remove(head)
            # Shared before the allocation, which may take back idle kept blocks: not these.
            self.pool.share(reused)
            head.blocks = reused + self.pool.allocate(kv_blocks(len(head.prompt), bt) - len(reused))
            head.cached = head.reused = len(reused) * bt
            if self.prefix_cache and head.prompt_logprobs is None:
                self.pool.looked_up(len(head.prompt), head.reused)
            head.promised = need - (len(head.blocks) - len(reused))
            self.running.append(head)
            joined.append(head)
            if self.prefix_cache:
                computing.update(head._digests[len(reused) :])
            if self.on_start is not None:
                self.on_start(head)
        return joined

    def _cached(self, s: Sequence) -> list[int]:
        """The kept blocks `s`'s prompt may begin with: at most all but its last token's (whose
        logits its prefill must give, and whose block it writes into), none where every prompt
        token must be computed (scored) or the batcher keeps nothing."""
        if not self.prefix_cache:
            return []
        bt = self.pool.block_tokens
        if not s._digests:
            s._digests = chain(s.prompt, bt, root(s.adapter, s.scope))
        if s.prompt_logprobs is not None:
            return []
        return self.pool.cached(s._digests[: (len(s.prompt) - 1) // bt])

    def _keep(self, s: Sequence) -> None:
        """Leave `s`'s full blocks of written K/V in the prefix cache: the prompt's after its
        prefill, the answer's too as it ends. Not where its forward failed."""
        if not self.prefix_cache or s.error is not None or not s.blocks:
            return
        bt = self.pool.block_tokens
        written = (*s.prompt, *s.generated)[: s.cached]
        digests = s._digests[: len(written) // bt]
        start = digests[-1] if digests else root(s.adapter, s.scope)
        digests += chain(written[len(digests) * bt :], bt, start)
        self.pool.keep(digests, s.blocks[: len(digests)])

    def _grow(self, s: Sequence) -> None:
        """One more block when the next token would not fit: promised at admission, so it is free."""
        if s.cached + 1 > len(s.blocks) * self.pool.block_tokens:
            s.blocks.extend(self.pool.allocate(1))
            s.promised -= 1

    def _forward(self, slices: list[Slice], group: list[Sequence]) -> Any:
        import torch

        # Only a prefill scores a prompt: a decode step's slices are no sequence's first.
        scored = {i: s.prompt_logprobs for i, s in enumerate(group) if s.prompt_logprobs is not None and not s.cached}
        with torch.inference_mode():
            if not scored:
                return self.engine.forward(slices)
            logits, scores = self.engine.forward_scored(slices, scored)
        for i, picks in scores.items():
            group[i].prompt_picked = picks
        return logits

    def _sample_all(self, group: list[Sequence], logits: Any) -> list[int]:
        """Each sequence's next token from its row of `logits`: the greedy ones from one argmax
        over the whole batch, read back at once (one device synchronisation a step, not one a
        sequence), the sampled ones row by row. The rows of penalized sequences are changed
        first, on a copy (the batch's own rows are the forward's)."""
        import torch

        raw = logits
        penalized = [i for i, s in enumerate(group) if s.sampling.penalized]
        held_to = {i: self._allowed(s) for i, s in enumerate(group) if s.allowed is not None}
        # min_tokens: the model's end of text cannot be picked before them (vLLM's), so that the
        # answer runs on rather than ends (past max_tokens it ends by length all the same).
        held = [i for i, s in enumerate(group) if len(s.generated) < s.sampling.min_tokens and self._ends(s)]
        closing = [i for i, s in enumerate(group) if _thinks_past_budget(s)]
        if penalized or held or held_to or closing:
            with torch.inference_mode():
                logits = logits.clone()
                for i in penalized:
                    logits[i] = _penalized(group[i], logits[i])
                for i in held:  # as vLLM holds min_tokens: neither its end of text nor a stop token
                    logits[i, sorted(self._ends(group[i]))] = float("-inf")
                _keep_only(
                    logits,
                    {i: _allowed_mask(group[i], allowed, logits) for i, allowed in held_to.items() if allowed},
                )
                for i in closing:  # its thinking has had its budget: its closing tag, whatever else it wanted
                    logits[i] = float("-inf")
                    logits[i, group[i].close_id] = 0.0
        greedy = torch.argmax(logits, dim=-1).tolist()
        tokens = [greedy[i] if s.sampling.greedy else self._sample(s, logits[i]) for i, s in enumerate(group)]
        asked = [i for i, s in enumerate(group) if s.logprobs is not None]
        if asked:
            # The model's own distribution (the forward's rows, before any penalty), as vLLM reports it.
            picks = of_rows(raw[asked], [tokens[i] for i in asked], [group[i].logprobs or 0 for i in asked])
            for i, pick in zip(asked, picks, strict=True):
                group[i].picked.append(pick)
        return tokens

    @staticmethod
    def _allowed(s: Sequence) -> list[int]:
        """The ids `s`'s format lets its next token be; none (and `s` failed) where its format
        cannot be held to (a part of a schema its parser meets only now)."""
        assert s.allowed is not None
        try:
            return s.allowed(s.generated)
        except Exception as exc:  # its own failure, not the batch's
            s.error = exc
            return []

    def _sample(self, s: Sequence, logits: Any) -> int:
        import torch

        sampling = s.sampling
        if sampling.greedy:
            return int(torch.argmax(logits))
        with torch.inference_mode():
            logits = logits.float() / sampling.temperature
            if 0 < sampling.top_k < logits.shape[-1]:
                kth = torch.topk(logits, sampling.top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            if sampling.min_p > 0:
                probs = probs.masked_fill(probs < sampling.min_p * probs.max(), 0.0)
            if sampling.top_p < 1.0:
                # Nucleus: the smallest set of most likely tokens whose mass reaches top_p.
                sorted_probs, order = torch.sort(probs, descending=True)
                mass = sorted_probs.sum()
                keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p * mass
                keep[0] = True
                probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
            return int(torch.multinomial(probs, 1, generator=self._generator_of(s, logits.device)))

    def _generator_of(self, s: Sequence, device: Any) -> Any:
        """A seeded request's own generator, so that its tokens do not depend on what else the
        batch sampled; the batcher's for the others."""
        seed = s.sampling.generator_seed
        if seed is None:
            return self.generator
        if s._generator is None:
            import torch

            s._generator = torch.Generator(device=device).manual_seed(seed)
        return s._generator

    def _ends(self, s: Sequence) -> set[int]:
        """The tokens that end `s`'s answer and are no part of it: the model's end of text, and
        the stop tokens it asked for (vLLM's stop_token_ids)."""
        return self.eos | set(s.sampling.stop_token_ids) if s.sampling.stop_token_ids else self.eos

    def _append(self, s: Sequence, token: int) -> None:
        s.generated.append(token)
        if s.thinking_budget is not None and token == s.close_id:
            s._thinking_closed = True
        if s.first_token_at is None:
            s.first_token_at = time.time()
        if token in s.sampling.stop_token_ids:
            # Before its text is streamed: a stop token never reaches the answer, as an end of text does not.
            s.finish, s.stop_reason = "stop", token
            s.text = self.tokenizer.decode(s.generated[:-1], skip_special_tokens=True)
            self._keep_logprobs(s)
            self._stream(s, s.text, final=True)
            return
        if s.on_chunk is not None or s.stop:
            if s._decoded is None:
                s._decoded = IncrementalText(self.tokenizer)
            text = s._decoded.update(s.generated)
            self._stream(s, text)
            if (stopped := first_stop(text, s.stop)) is not None:
                cut, s.stop_reason = stopped
                s.text, s.finish = text[:cut], "stop"
                self._keep_logprobs(s)
                return
        if token in self.eos:
            s.finish = "stop"
        elif len(s.generated) >= s.max_tokens:
            s.finish = "length"
        if s.finish is not None:
            # Decoded whole once, at the end: the answer's text is the tokenizer's own.
            s.text = self.tokenizer.decode(s.generated, skip_special_tokens=True)
            self._keep_logprobs(s)
            self._stream(s, s.text, final=True)

    def _keep_logprobs(self, s: Sequence) -> None:
        """An ended sequence's picks as its result gives them, decoded once (asked for only)."""
        if s.logprobs is not None:
            s.logprob_entries = entries(self.tokenizer, _answered(s.picked, self._ends(s)))
        if s.prompt_logprobs is not None:
            s.prompt_entries = prompt_entries(self.tokenizer, s.prompt, s.prompt_picked)

    def _stream(self, s: Sequence, text: str, *, final: bool = False) -> None:
        """Hand the streamed sequence's newly settled text to its on_chunk (inference.stream_text);
        asked for its log probabilities, each piece carries those of the tokens picked since the
        last (an end of sequence that ended it is no token of the answer)."""
        if s.on_chunk is None:
            return
        piece = newly_settled(text, s._sent, final=final)
        if not piece:
            return
        shown = piece if s._sent else s.opened + piece
        if s.logprobs is None:
            s.on_chunk(shown)
        else:
            picks = _answered(s.picked, self._ends(s))
            s.on_chunk(picked_piece(shown, entries(self.tokenizer, picks[s._streamed_picks :])))
            s._streamed_picks = len(picks)
        s._sent += piece

    def _retire(self, s: Sequence) -> None:
        if s in self.running:
            self.running.remove(s)
            self._keep(s)
        self._release(s)

    def _release(self, s: Sequence) -> None:
        if s.blocks:
            self.pool.free(s.blocks)
        s.blocks, s.promised = [], 0


def _answered(picked: list[Picked], eos: Any) -> list[Picked]:
    """The picks of the answer's tokens: an end-of-sequence token that ended it is not one."""
    return picked[:-1] if picked and picked[-1][0] in eos else picked


def run_until_idle(batcher: Batcher) -> list[Sequence]:
    """Step until nothing waits or runs (tests, benchmarks); the sequences in the order they ended."""
    ended: list[Sequence] = []
    while not batcher.idle:
        batcher.wait_for_formats()
        ended.extend(batcher.step())
    return ended


def _keep_only(logits: Any, allowed: dict[int, Any]) -> None:
    """Each named row of `logits` keeps its values where its mask is true (formats: the tokens
    that keep an answer to its format), the rest -inf, in place."""
    import torch

    if not allowed:
        return
    held = torch.tensor(list(allowed), device=logits.device)
    logits[held] = logits[held].masked_fill(~torch.stack(list(allowed.values())), float("-inf"))


def _allowed_mask(s: Sequence, allowed: list[int], logits: Any) -> Any:
    """`allowed` (s's format's ids for its next token) as a mask over a row of `logits`: the one
    made for the step before where its format gave the very same list (inside a string, most
    steps), else made from the list read without a Python int object each (a list of 30,000 ids:
    about 0.4 ms so, against 3.5 ms for `torch.tensor` of it; BENCHMARKS.md, "Answers held to a
    format")."""
    import torch

    kept = s._allowed_mask
    if kept is not None and kept[0] is allowed and kept[1].device == logits.device:
        return kept[1]
    mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[torch.frombuffer(array.array("q", allowed), dtype=torch.int64).to(logits.device)] = True
    s._allowed_mask = (allowed, mask)
    return mask


def _thinks_past_budget(s: Sequence) -> bool:
    """Whether `s`'s next token is to close its thinking (gpuportal.wire.reasoning.past_budget)."""
    if s.thinking_budget is None:
        return False
    tags = (s.open_id, s.close_id) if s.open_id is not None and s.close_id is not None else None
    return past_budget(s.generated, s.thinking_budget, tags, opened=bool(s.opened), closed=s._thinking_closed)


def _ready(s: Sequence) -> bool:
    return s.allowed is None or s.allowed.ready()


def eos_ids(model: Any) -> set[int]:
    """The ids that end a generation, as generate() reads them (generation config, then config)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None) if config is None else None
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}


def _penalized(s: Sequence, logits: Any) -> Any:
    """One sequence's row of logits with its penalties applied: OpenAI's presence and frequency
    penalties over the tokens it has generated (each token's count), then the multiplicative
    repetition penalty of vLLM and Hugging Face over its prompt's and its answer's tokens, then
    OpenAI's logit_bias."""
    import torch

    sampling, vocab = s.sampling, logits.shape[-1]
    if (sampling.presence_penalty or sampling.frequency_penalty) and s.generated:
        ids = torch.tensor(s.generated, device=logits.device)
        counts = torch.bincount(ids[ids < vocab], minlength=vocab).to(logits.dtype)
        present = (counts > 0).to(logits.dtype)
        logits = logits - sampling.frequency_penalty * counts - sampling.presence_penalty * present
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*s.prompt, *s.generated) if t < vocab}), device=logits.device)
        if len(seen):
            values, penalty = logits[seen], sampling.repetition_penalty
            penalized = torch.where(values > 0, values / penalty, values * penalty)
            logits = logits.index_put((seen,), penalized)  # a new tensor: the row given stays as it was
    if sampling.logit_bias:  # OpenAI's: added to the logits of the tokens it names (checked in vocabulary)
        ids = torch.tensor([token for token, _ in sampling.logit_bias], device=logits.device)
        biases = torch.tensor([bias for _, bias in sampling.logit_bias], device=logits.device, dtype=logits.dtype)
        logits = logits.index_put((ids,), logits[ids] + biases)
    return logits
