"""What a replica does with a request: generate text (causal LMs), embed texts (encoders,
inference.embedding), or run a forward pass on JSON tensors (plain PyTorch modules). Runs inside
the replica process; no Django.

`Server` is the replica's serving thread: it takes requests from its deployment's queue while the
replica is serving (seed 002: whichever replica has room first wins). Text requests on a replica
with a KV block pool run continuously batched (inference.batching), admitted by free blocks;
others run one at a time. Forward steps run under the host's lock (so weights never move under a
running request), and each outcome is recorded in the queue.

The preemption barrier: a sleep or stop first turns the replica to draining, so nothing
new starts, then waits up to its drain timeout for the requests in flight. Past the deadline it sets
the host's abort flag: generation stops at its next token (`AbortOnFlag`, or the batch's next step),
the requests are given back to the head of their queue (not counted as attempts), and only then do
the weights move. A forward pass cannot be interrupted: it finishes, and its answer is kept.

A caller who leaves (a stream's client disconnects) or cancels a request a replica holds has it
asked stopped (gpuportal.wire.requestqueue: the replica's stops): the serving loop reads the asks
at most every STOPS_EVERY_S while it generates, and the request ends there, `cancelled`, with the
text generated until then; its KV blocks go to the others at once, as vLLM aborts a request whose
client has gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import redis
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from gpuportal.wire import adapters, kvstats, prefix_cache, truncation
from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.reasoning import (
    CONTINUE_FINAL,
    TEMPLATE_KWARGS,
    THINKING_BUDGET,
    counted,
    opened_by,
    past_budget,
    tag_ids,
)
from gpuportal.wire.requestqueue import (
    BAD_INPUT,
    STOPPED,
    Fence,
    Fenced,
    LeaseLapsed,
    NotTaken,
    Request,
    RequestQueue,
    family_of_loader,
)
from gpuportal.wire.sampling import (
    COUNT_ONLY,
    DEFAULT_MAX_TOKENS,
    FORMATS,
    PROMPT_TOKEN_IDS,
    SCHEMA_FIELD,
    STOP_REASON,
    Sampling,
    first_stop,
    fitted_max_tokens,
    max_tokens_bound,
)
from gpuportal.wire.tools import TOOLS
from inference.errors import BadInput, TooLong
from inference.lazy_imports import from_transformers
from inference.stream_text import newly_settled
from inference.token_logprobs import entries, of_prompt, of_rows, prompt_entries

if TYPE_CHECKING:
    from inference.batching import Batcher, Sequence
    from inference.constrained import Held
    from inference.embedding import Embedder
    from inference.paged import PagedModel

log = logging.getLogger("inference.serving")


class ServingHost(Protocol):
    """What the serving threads use of their replica's host (inference.host.ReplicaHost is
    one): declared here, so that this module need not import the host's."""

    replica_id: str
    loader: str
    tokenizer: Any | None
    paged: PagedModel | None
    fence: Fence | None
    # The node epoch it was started under (gpuportal.wire.node_lease), None where it has none.
    node_fence: NodeFence | None
    # Set while the replica takes requests; `abort`: a drain's deadline passed.
    accepting: threading.Event
    abort: threading.Event
    # Held by each forward step, so the weights never move under one.
    lock: AbstractContextManager[Any]
    on_stop_taking: Callable[[], None] | None
    # Whose requests share its prefix cache (gpuportal.wire.prefix_cache.MODES).
    prefix_cache: str

    def begin_request(self) -> bool: ...
    def end_request(self) -> None: ...
    def executor(self) -> Executor: ...
    def kv_stats(self) -> dict[str, Any] | None: ...
    def on_stale(self, reason: str) -> None: ...


# Requests a busy batch takes from the queue between two steps, at most (see Server._take_more).
MORE_PER_STEP = 64
# How often a replica that generates reads its callers' asks to stop: a round trip to Redis that
# a decode step of a few milliseconds should not pay each time; a caller who left waits this long
# at most for the tokens generated for nobody to stop.
STOPS_EVERY_S = 0.2


class Aborted(Exception):
    """The replica is going to sleep or stopping and cut the request short: give it back, unfinished."""


class AbortOnFlag:
    """A transformers stopping criterion: stop every sequence once `flag` is set (a drain's deadline).

    Duck-typed rather than a StoppingCriteria subclass, so this module imports no transformers;
    generate() only calls it. `fired` tells a generation cut short from one that ended on its own.
    """

    def __init__(self, flag: threading.Event):
        self.flag = flag
        self.fired = False

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        stop = self.flag.is_set()
        self.fired = self.fired or stop
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def generation_params(params: dict[str, Any]) -> tuple[int | None, Sampling, list[str]]:
    """max_tokens, sampling (gpuportal.wire.sampling) and stop strings of a text request,
    defaults filled in; max_tokens None where the request leaves it to the room the replica has
    (a /v1 chat that asks for no length: gpuportal.wire.sampling.DEFAULT_CHAT_MAX_TOKENS)."""
    if "max_tokens" in params and params["max_tokens"] is None:
        max_tokens = None
    else:
        max_tokens = int(params.get("max_tokens") or DEFAULT_MAX_TOKENS)
    stop = params.get("stop") or []
    return max_tokens, Sampling.of(params), [stop] if isinstance(stop, str) else list(stop)


class StopWhenAsked:
    """A transformers stopping criterion: stop once `asked()` says the request's caller asked it
    stopped, read at most every STOPS_EVERY_S (a round trip each). Duck-typed, as AbortOnFlag is."""

    def __init__(self, asked: Callable[[], bool]):
        self.asked = asked
        self.fired = False
        self.read_at = time.monotonic()

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        if not self.fired and time.monotonic() - self.read_at >= STOPS_EVERY_S:
            self.read_at = time.monotonic()
            self.fired = self.asked()
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


class OpenAIPenalties:
    """A transformers logits processor applying OpenAI's presence and frequency penalties to the
    tokens generated so far (those after the prompt's `start`); transformers has the
    repetition penalty, not these. Duck-typed, as AbortOnFlag is."""

    def __init__(self, sampling: Sampling, start: int):
        self.sampling, self.start = sampling, start

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        generated = input_ids[:, self.start :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        present = (counts > 0).to(scores.dtype)
        return scores - self.sampling.frequency_penalty * counts - self.sampling.presence_penalty * present


class ThinkingBudget:
    """A transformers logits processor closing an answer's thinking once it has had its budget's
    tokens (gpuportal.wire.reasoning.past_budget), as the paged engine closes it. Duck-typed."""

    def __init__(self, budget: int, tags: tuple[int, int], start: int, *, opened: bool):
        self.budget, self.tags, self.start, self.opened = budget, tags, start, opened

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        answer = input_ids[0, self.start :].tolist()
        closed = self.tags[1] in answer
        if past_budget(answer, self.budget, self.tags, opened=self.opened, closed=closed):
            scores = scores.clone()
            scores[0] = float("-inf")
            scores[0, self.tags[1]] = 0.0
        return scores


# The longest token of each tokenizer a replica serves with, in UTF-8 bytes, read from its whole
# vocabulary once: tens of milliseconds for 150,000 tokens, which every request paid on the serving
# thread while it read it anew (an Executor is made per request).
_LONGEST_TOKEN: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_bytes(tokenizer: Any) -> int:
    """The longest of `tokenizer`'s tokens in UTF-8 bytes (0 for an empty vocabulary)."""
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):  # TypeError: one no weak reference can hold, read each time
        pass
    longest = max((len(token.encode()) for token in tokenizer.get_vocab()), default=0)
    with contextlib.suppress(TypeError):
        _LONGEST_TOKEN[tokenizer] = longest
    return longest


def echoed(tokenizer: Any, request: Request, output: dict[str, Any]) -> dict[str, Any]:
    """`output`, with the text of a prompt given as token ids where its answer echoes it (the web,
    which has no tokenizer, begins the answer's text with it)."""
    if request.params.get("echo") and isinstance(request.input, list) and tokenizer is not None:
        output["prompt_text"] = tokenizer.decode(request.input)
    return output


class Executor:
    """Runs requests on a loaded model."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None,
        abort: threading.Event | None = None,
        embedder: Embedder | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        # Set by a drain past its deadline: generation stops at its next token and raises Aborted.
        self.abort = abort if abort is not None else threading.Event()
        # An encoder's (a transformers-embedding deployment): it embeds, and does nothing else.
        self.embedder = embedder

    def run(
        self, request: Request, on_chunk: Callable[[str], None] | None, asked_stop: Callable[[], bool] | None = None
    ) -> dict[str, Any]:
        """The request's output. `asked_stop`: whether its caller asked it stopped (a generation
        then ends early, its finish_reason STOPPED)."""
        # The web admits only the kinds a deployment takes; these guard a request that was queued
        # under an older deployment of the same name.
        if (request.kind == "embed") != (self.embedder is not None):
            raise BadInput(
                "this deployment is an embedding model: send its text to POST /v1/embeddings"
                if self.embedder is not None
                else "this deployment is not an embedding model"
            )
        if request.kind == "embed":
            return self.embed(request.input)
        if request.kind == "forward":
            return self.forward(request.input)
        if request.params.get(COUNT_ONLY):
            return self.tokenized(request)
        prompt = self.prompt_of(self.truncated(request))
        opened = self.opened(request, prompt)
        if opened and on_chunk is not None:
            on_chunk = _begun_with(opened, on_chunk)
        result = self.generate(prompt, request.params, on_chunk, asked_stop, opened=opened)
        if request.kind == "chat":
            result["message"] = {"role": "assistant", "content": result["text"]}
        return echoed(self.tokenizer, request, result)

    def truncated(self, request: Request) -> Request:
        """A conversation asked truncated (Responses' `truncation: auto`) cut to its fewest
        earliest turns whose prompt and max_tokens (at least one token) fit the model's context
        (gpuportal.wire.truncation), as the paged engine's Server cuts it to its batch's room;
        any other request as it is."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        asked = request.params.get(truncation.TRUNCATION) == truncation.AUTO
        if not asked or not isinstance(request.input, list) or not limit:
            return request
        room = max(1, request.params.get("max_tokens") or 1)

        def fits(messages: list[dict[str, Any]]) -> bool:
            prompt = self.prompt_of(dataclasses.replace(request, input=messages), sized=False)
            return len(self.tokenizer(prompt).input_ids) + room <= limit

        found = truncation.shortest_fit(request.input, fits)
        return request if found is None else dataclasses.replace(request, input=found[0])

    def tokenized(self, request: Request) -> dict[str, Any]:
        """A request asked only to count its prompt (COUNT_ONLY): its tokens, counted as an
        answer's usage counts them, and a prompt given as ids decoded. Not refused for its size:
        how far past the model's context a prompt is is what a caller counting it wants to know."""
        prompt = self.prompt_of(request, sized=False)
        ids = prompt if isinstance(prompt, list) else [int(t) for t in self.tokenizer(prompt).input_ids]
        output: dict[str, Any] = {
            "text": "",
            "finish_reason": "stop",
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)},
            PROMPT_TOKEN_IDS: ids,
        }
        if isinstance(prompt, list):
            output["prompt_text"] = self.tokenizer.decode(ids)
        return output

    def prompt_of(self, request: Request, *, sized: bool = True) -> str | list[int]:
        """A text request's prompt: a chat's messages through the model's template, a completion's
        text, or the token ids a completion was given (vLLM's; checked against the vocabulary);
        refused where it could never fit the model's context (`sized`)."""
        if self.tokenizer is None:
            raise BadInput("this deployment has no tokenizer: send JSON tensors (kind forward) instead of text")
        if request.kind == "generate" and isinstance(request.input, list):
            vocab = self._vocab_size
            beyond = [token for token in request.input if vocab is None or not 0 <= int(token) < vocab]
            if beyond:
                raise BadInput(f"prompt: token {beyond[0]} is not in the model's vocabulary of {vocab} tokens")
            return [int(token) for token in request.input]
        prompt = (
            self.chat_prompt(
                request.input,
                request.params.get(TOOLS),
                request.params.get(TEMPLATE_KWARGS),
                continued=bool(request.params.get(CONTINUE_FINAL)),
            )
            if request.kind == "chat"
            else str(request.input)
        )
        if sized:
            self.refuse_oversized(prompt)
        return prompt

    @functools.cached_property
    def _ends(self) -> set[int]:
        """What ends an answer without being part of it: the model's own ends (its generation
        config may list several, as Llama 3's does) and its tokenizer's."""
        from inference.batching import eos_ids

        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        return eos_ids(self.model) | ({eos} if eos is not None else set())

    @functools.cached_property
    def _prompt_bound(self) -> tuple[int, int, int] | None:
        """(most bytes a prompt that could fit may have, the model's context in tokens, the longest
        token of its tokenizer in bytes), or None where either is unknown. No token stands for more
        bytes than its text's UTF-8 length (a byte-level or SentencePiece token's text spells each
        byte with a character of one or more), so a prompt longer than the context times that can
        never fit: it is refused without spending seconds tokenising megabytes."""
        context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if not context or not hasattr(self.tokenizer, "get_vocab"):
            return None
        longest = longest_token_bytes(self.tokenizer)
        return (int(context) * longest, int(context), longest) if longest else None

    def refuse_oversized(self, prompt: str) -> None:
        """BadInput for a prompt that can never fit the model's context, told by its size alone."""
        bound = self._prompt_bound
        if bound is None or len(prompt) <= bound[0] // 4:  # 4 bytes a character at most: fits
            return
        size = len(prompt.encode())
        if size > bound[0]:
            raise TooLong(
                f"input too long: {size} bytes can never fit the model's context of {bound[1]} tokens "
                f"(no token of its tokenizer is longer than {bound[2]} bytes)"
            )

    @functools.cached_property
    def _vocab_size(self) -> int | None:
        """How many tokens the model's logits cover (its output layer's rows), None where unknown."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        return int(head.weight.shape[0]) if head is not None else getattr(self.model.config, "vocab_size", None)

    def refuse_unknown_tokens(self, sampling: Sampling) -> None:
        """BadInput for a logit_bias or stop_token_ids naming a token the model's vocabulary does
        not have (the web cannot know its size; an index past it would fail the whole batch's step)."""
        named = (
            ("logit_bias", [token for token, _ in sampling.logit_bias]),
            ("stop_token_ids", sampling.stop_token_ids),
        )
        for name, tokens in named:
            vocab = self._vocab_size if tokens else None
            beyond = [token for token in tokens if vocab is None or token >= vocab]
            if beyond:
                raise BadInput(f"{name}: token {beyond[0]} is not in the model's vocabulary of {vocab} tokens")

    def chat_prompt(
        self,
        messages: Any,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        *,
        continued: bool = False,
    ) -> str:
        """The messages (and the functions the chat may call) through the model's chat template,
        given `extra` too (the caller's chat_template_kwargs); `continued`, the last message (the
        assistant's) left open for the answer to go on from, no new turn begun. BadInput where
        the template refuses them (roles out of its order, a tool's message where it takes none)."""
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=not continued,
                    continue_final_message=continued,
                    tokenize=False,
                    **(extra or {}),
                )
            except Exception as exc:  # jinja2's TemplateError, a template's raise_exception: the messages'
                raise BadInput(f"messages: the model's chat template refused them: {exc}") from None
        # A model without a chat template still answers: a plain transcript, then its turn (the
        # functions first, and the calls made as Hermes' template writes them).
        lines = [f"tools: {json.dumps([tool['function'] for tool in tools])}"] if tools else []
        for m in messages:
            made = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in m.get("tool_calls", ())
            ]
            calls = "".join(f"<tool_call>{json.dumps(call)}</tool_call>" for call in made)
            lines.append(f"{m['role']}: {m['content']}{calls}")
        return "\n".join(lines if continued else [*lines, "assistant:"])

    def opened(self, request: Request, prompt: str | list[int]) -> str:
        """What of a chat's prompt opened the answer's thinking, which its text begins with
        (gpuportal.wire.reasoning); "" for others, and for an answer held to a format (whose
        first token is the format's: it has no room to think)."""
        if request.kind != "chat" or not isinstance(prompt, str):
            return ""
        if any(request.params.get(name) is not None for name in FORMATS):
            return ""
        return opened_by(prompt)

    def sequence(self, request: Request, on_chunk: Callable[[str], None] | None) -> Sequence:
        """A text request as a Sequence for the batcher (inference.batching); BadInput as run() would."""
        from inference.batching import Sequence

        prompt = self.prompt_of(request)
        max_tokens, sampling, stop = generation_params(request.params)
        self.refuse_unknown_tokens(sampling)
        ids = prompt if isinstance(prompt, list) else [int(t) for t in self.tokenizer(prompt).input_ids]
        if not ids:
            raise BadInput("the prompt is empty: nothing to continue")
        allowed = self.format_allowed(request.params)
        # max_tokens None: the default, which the batcher fits to the room it has (Batcher.check).
        return Sequence(
            ids,
            max_tokens_bound(request.params) if max_tokens is None else max_tokens,
            stop,
            on_chunk,
            sampling=sampling,
            tag=request,
            fit=max_tokens is None,
            logprobs=request.params.get("logprobs"),
            prompt_logprobs=request.params.get("logprobs") if request.params.get("echo") else None,
            allowed=allowed,
            opened=self.opened(request, prompt),
            close_id=tags[1] if (tags := tag_ids(self.tokenizer)) is not None else None,
            open_id=tags[0] if tags is not None else None,
            thinking_budget=request.params.get(THINKING_BUDGET),
        )

    def format_allowed(self, params: dict[str, Any]) -> Held | None:
        """What a request's format (OpenAI's response_format, vLLM's guided_choice or
        guided_regex) lets each next token be (inference.constrained); None for free text.
        BadInput for a format it cannot hold to."""
        schema, choices, regex = (params.get(name) for name in FORMATS)
        if schema is None and choices is None and regex is None:
            return None
        from inference.constrained import held_to

        vocab = self._vocab_size or len(self.tokenizer)
        field = str(params.get(SCHEMA_FIELD) or "response_format")  # the caller's name for the schema
        return held_to(
            self.tokenizer, vocab, self._ends, schema=schema, choices=choices, regex=regex, schema_field=field
        )

    def generate(
        self,
        prompt: str | list[int],
        params: dict[str, Any],
        on_chunk: Callable[[str], None] | None,
        asked_stop: Callable[[], bool] | None = None,
        opened: str = "",
    ) -> dict[str, Any]:
        """The answer to `prompt`, one request alone through transformers' generate(); its text
        begun with `opened` (what of a chat's prompt opened its thinking, Executor.opened)."""
        import torch

        asked, sampling, stop = generation_params(params)
        self.refuse_unknown_tokens(sampling)
        ids = (
            torch.tensor([prompt])
            if isinstance(prompt, list)
            else self.tokenizer(prompt, return_tensors="pt").input_ids
        )
        limit = getattr(self.model.config, "max_position_embeddings", None)
        max_tokens = (
            asked if asked is not None else fitted_max_tokens(ids.shape[1], limit, most=max_tokens_bound(params))
        )
        if limit is not None and ids.shape[1] + max_tokens > limit:
            raise TooLong(
                f"input too long: {ids.shape[1]} prompt tokens plus max_tokens {max_tokens} exceed "
                f"the model's context of {limit} tokens"
            )
        device = next(self.model.parameters()).device
        eos = self.tokenizer.eos_token_id
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "pad_token_id": self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos,
            "do_sample": not sampling.greedy,
        }
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(0, sampling.top_k))
            if sampling.min_p > 0:
                kwargs["min_p"] = sampling.min_p
        if sampling.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = sampling.repetition_penalty
        if sampling.logit_bias:
            kwargs["sequence_bias"] = [[[token], bias] for token, bias in sampling.logit_bias]
        if sampling.min_tokens:
            kwargs["min_new_tokens"] = min(sampling.min_tokens, max_tokens)  # as the paged engine holds it
        ends = set(self._ends)  # and the stop tokens asked for
        if sampling.stop_token_ids:
            # Ended as by the end of text (min_new_tokens holds them back too); cut from the text below.
            ends |= set(sampling.stop_token_ids)
            kwargs["eos_token_id"] = sorted(ends)
        if (allowed := self.format_allowed(params)) is not None:
            start = ids.shape[1]  # generate() hands over the prompt too: the format is the answer's
            kwargs["prefix_allowed_tokens_fn"] = lambda batch, tokens: allowed(tokens[start:].tolist())
        if on_chunk is not None:
            kwargs["streamer"] = _ChunkStreamer(self.tokenizer, on_chunk, skipped=set(sampling.stop_token_ids))
        StoppingCriteriaList, LogitsProcessorList = from_transformers("StoppingCriteriaList", "LogitsProcessorList")
        processors: list[Any] = []
        if sampling.presence_penalty or sampling.frequency_penalty:
            processors.append(OpenAIPenalties(sampling, ids.shape[1]))
        budget, tags = params.get(THINKING_BUDGET), tag_ids(self.tokenizer)
        if budget is not None and tags is not None:
            processors.append(ThinkingBudget(budget, tags, ids.shape[1], opened=bool(opened)))
        if processors:
            kwargs["logits_processor"] = LogitsProcessorList(processors)
        logprobs = params.get("logprobs")
        if logprobs is not None:
            # The model's own logits at each step, before any processor (as the paged engine reports).
            kwargs.update(output_logits=True, return_dict_in_generate=True)

        abort = AbortOnFlag(self.abort)
        stop_asked = StopWhenAsked(asked_stop) if asked_stop is not None else None
        stopping = [abort] if stop_asked is None else [abort, stop_asked]
        # A seed reaches generate() through torch's global generators (manual_seed seeds every
        # GPU's), forked so that nothing else in the process sees it (requests run one at a time
        # here: the host's lock).
        cuda = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda, enabled=sampling.seed is not None):
            if sampling.seed is not None:
                torch.manual_seed(sampling.generator_seed)
            out = self.model.generate(
                ids.to(device),
                attention_mask=torch.ones_like(ids).to(device),
                stopping_criteria=StoppingCriteriaList(stopping),
                **kwargs,
            )
        if abort.fired:
            raise Aborted("cut short by a drain past its deadline")
        sequences = out.sequences if logprobs is not None else out
        new = sequences[0, ids.shape[1] :]
        ended_on_stop = len(new) > 0 and int(new[-1]) in sampling.stop_token_ids
        text = self.tokenizer.decode(new[:-1] if ended_on_stop else new, skip_special_tokens=True)
        finish = "length" if len(new) >= max_tokens and not ended_on_stop else "stop"
        stop_reason: str | int | None = int(new[-1]) if ended_on_stop else None
        if (stopped := first_stop(text, stop)) is not None:
            (cut, stop_reason), finish = stopped, "stop"
            text = text[:cut]
        elif stop_asked is not None and stop_asked.fired:
            finish = STOPPED
        output: dict[str, Any] = {
            "text": opened + text,
            "finish_reason": finish,
            "usage": {
                "prompt_tokens": int(ids.shape[1]),
                "completion_tokens": len(new),
                "total_tokens": int(ids.shape[1] + len(new)),
            },
        }
        if stop_reason is not None:
            output[STOP_REASON] = stop_reason
        counted(output, new.tolist(), tags[1] if tags is not None else None)
        if logprobs is not None:
            tokens = new.tolist()
            picked = of_rows(torch.cat(out.logits)[: len(tokens)], tokens, [logprobs] * len(tokens))
            if picked and picked[-1][0] in ends:
                picked = picked[:-1]  # the end-of-sequence token that ended it is no token of the answer
            output["logprobs"] = entries(self.tokenizer, picked)
            if params.get("echo"):
                scored = of_prompt(self.model, ids.to(device), logprobs)
                output["prompt_logprobs"] = prompt_entries(self.tokenizer, ids[0].tolist(), scored)
        return output

    def embed(self, texts: Any) -> dict[str, Any]:
        from inference.embedding import Interrupted

        assert self.embedder is not None
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise BadInput("input must be a non-empty string or a non-empty list of them")
        try:
            return self.embedder.embed(texts, self.abort)
        except Interrupted as exc:
            raise Aborted(str(exc)) from None

    def forward(self, data: Any) -> dict[str, Any]:
        import torch

        # The input goes where the module's tensors are, in their dtype; a module with none (an
        # Identity, a pure function) takes the default dtype on the CPU.
        first = next(itertools.chain(self.model.parameters(), self.model.buffers()), None)
        dtype = first.dtype if first is not None else torch.get_default_dtype()
        device = first.device if first is not None else "cpu"
        try:
            tensor = torch.tensor(data, dtype=dtype, device=device)
        except (TypeError, ValueError) as exc:
            raise BadInput(f"input is not a tensor of numbers: {exc}") from None
        try:
            with torch.no_grad():
                out = self.model(tensor)
        except RuntimeError as exc:  # shape mismatches surface as RuntimeError
            raise BadInput(f"the model cannot take this input: {' '.join(str(exc).split())}") from None
        return {"output": out.float().cpu().tolist(), "shape": list(out.shape)}


def _begun_with(opened: str, emit: Callable[[str], None]) -> Callable[[str], None]:
    """`emit`, its first piece begun with `opened`."""
    first = [True]

    def begun(piece: str) -> None:
        emit(opened + piece if first[0] else piece)
        first[0] = False

    return begun


class _ChunkStreamer:
    """A transformers streamer that hands each newly decoded piece of text to `emit`."""

    def __init__(self, tokenizer: Any, emit: Callable[[str], None], skipped: set[int] | None = None):
        self.tokenizer, self.emit = tokenizer, emit
        # Tokens that end the answer and are no part of its text (stop_token_ids: generate() hands
        # one over before it stops on it).
        self.skipped = skipped or set()
        self.tokens: list[int] = []
        self.sent = ""
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt itself
            self.prompt_seen = True
            return
        self.tokens.extend(token for t in value.reshape(-1).tolist() if (token := int(t)) not in self.skipped)
        self._emit(final=False)

    def end(self) -> None:
        self._emit(final=True)  # a last incomplete character, as the answer's text has it

    def _emit(self, *, final: bool) -> None:
        piece = newly_settled(self.tokenizer.decode(self.tokens, skip_special_tokens=True), self.sent, final=final)
        if piece:
            self.emit(piece)
            self.sent += piece


# How long a replica waits out an unreachable Redis (a restart) before it gives up: it then reports
# itself failed and exits, and the control plane gives its requests back and replaces it.
REDIS_OUTAGE_S = 30.0
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class PatientQueue:
    """The request queue as a replica writes to it: a write that meets an unreachable
    Redis is tried again, with backoff, for up to `outage_s`; a Redis that stays away calls
    `on_lost` (the replica reports `failed` and exits) rather than end the serving loop silently
    with a request half-done. Takes are not wrapped: the loop tries them again itself."""

    WRITES = frozenset({"start", "started", "chunk", "chunks", "finish", "fail", "give_back", "stopped"})

    def __init__(self, queue: RequestQueue, on_lost: Callable[[str], None], outage_s: float = REDIS_OUTAGE_S):
        self.queue, self.on_lost, self.outage_s = queue, on_lost, outage_s

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.queue, name)
        if name not in self.WRITES:
            return method

        def patiently(*args: Any, **kwargs: Any) -> Any:
            retrying = Retrying(
                retry=retry_if_exception_type(REDIS_DOWN),
                stop=stop_after_delay(self.outage_s),
                wait=wait_exponential(multiplier=0.05, max=2),
                before_sleep=lambda state: log.warning("Redis unreachable on %s; retrying (%s)", name, state.outcome),
                reraise=True,
            )
            try:
                return retrying(method, *args, **kwargs)
            except REDIS_DOWN as err:
                self.on_lost(f"Redis unreachable for {self.outage_s:g} s on {name}: {err}")
                raise

        return patiently


class Server(threading.Thread):
    """The replica's serving loop.

    With a KV block pool (a Llama-style causal LM, inference.paged) text requests run batched: the
    loop takes a request whenever nobody is waiting for blocks, then, between steps, as many more
    as are queued while the batch has blocks for all it holds (clients that sent theirs in the
    same moment start in the same step, not one a step), and steps the batch
    (inference.batching), which admits waiting sequences as blocks free up. At most one taken
    request waits for blocks here; the rest stay in the deployment's queue, where another replica
    may take them. A step's streamed tokens go to the queue together, in one round trip, before
    the answers that step ended. Without a pool (forward passes, other models) requests run one at a
    time through Executor.run, as before.

    Every taken request is counted in flight (host.begin_request) until its outcome is written,
    so a drain waits for all of them; a drain's abort ends the whole batch at its next step.

    While serving, the loop claims in the queue that the replica takes requests (gp:live, renewed
    by every take), so the web queues requests for it without a database read. The claim is
    withdrawn the moment the replica stops taking (the host calls `withdraw` as it leaves
    `serving`), before it reports asleep or stopped: the control plane's check for requests left
    waiting after that report then sees every request queued on the strength of the claim.
    """

    def __init__(self, host: ServingHost, queue: RequestQueue, deployment: str, poll_s: float = 1.0):
        super().__init__(name=f"serve-{host.replica_id[:8]}", daemon=True)
        self.host, self.deployment, self.poll_s = host, deployment, poll_s
        self.queue = PatientQueue(queue, self._lost)
        self.stopped = threading.Event()
        self.batch: Batcher | None = None
        self.kv = KvPublisher(host, queue)
        # Requests admitted in the current batch step, and when: written with their answer if
        # they end in the same step, else all together once it is over (see step).
        self.starting: dict[str, float] = {}
        # The current step's streamed tokens, (request id, text), written together after it.
        self.chunks: list[tuple[str, str]] = []
        # Whether the claim to take requests is made; under `_claim` with the check of
        # host.accepting, so a claim made as the replica stops taking is withdrawn, never left.
        self.live = False
        self._claim = threading.Lock()
        self.family = family_of_loader(host.loader)  # what its claim is for: text or tensors
        self.node = host.node_fence
        # Whether its node's lease was last found lapsed: said once when it lapses, once when back.
        self.paused = False
        # When the callers' asks to stop were last read (time.monotonic()): see STOPS_EVERY_S.
        self.stops_read_at = 0.0
        host.on_stop_taking = self.withdraw

    def run(self) -> None:
        while not self.stopped.is_set():
            busy = self.batch is not None and not self.batch.idle
            if not busy and not self.host.accepting.wait(timeout=self.poll_s):
                continue
            if self.host.accepting.is_set() and not (busy and self.batch is not None and self.batch.backlog):
                if not self.live:
                    self._announce()
                # Idle: block for the next request. Busy: only look, the batch must keep stepping.
                request = self._take(self.poll_s if not busy else 0)
                if request is not None:
                    self.accept(request)
                    self._take_more()
            if self.batch is not None and not self.batch.idle:
                self._end_stopped(self.batch)
            if self.batch is not None and not self.batch.idle:
                # Only formats being prepared: wait for them a moment rather than spin (then look
                # for new requests again, which go by them).
                self.batch.wait_for_formats()
                self.step()
            self.kv.publish()

    def _take_more(self) -> None:
        """The requests already queued, taken while the batch has blocks for every one it holds:
        at most MORE_PER_STEP, so that a flood of them delays the running batch's next step by no
        more than that many round trips."""
        for _ in range(MORE_PER_STEP):
            batch = self.batch
            if batch is None or not batch.has_room() or not self.host.accepting.is_set():
                return
            request = self._take(0)
            if request is None:
                return
            self.accept(request)

    def _lost(self, reason: str) -> None:
        lost = getattr(self.host, "on_queue_lost", None)
        if lost is not None:
            lost(reason)

    def _take(self, timeout: float) -> Request | None:
        try:
            if not self.live:
                request = self.queue.take(self.deployment, self.host.replica_id, timeout=timeout, node=self.node)
                self._resume()
                return request
            request, renewed = self.queue.take_renewing(
                self.deployment, self.host.replica_id, timeout, self.family, node=self.node
            )
            self._resume()
            if not renewed:
                # Gone while the replica still takes requests: Redis lost it (a restart without
                # persistence). Claimed again on the next turn, unless the replica stopped taking
                # meanwhile or its deployment was just deleted (see RequestQueue.announce).
                with self._claim:
                    self.live = False
            return request
        except Fenced as exc:
            # Written off (its node went silent): what it held went back to the queue already.
            self.host.on_stale(str(exc))
            return None
        except LeaseLapsed as exc:
            # Its agent has not renewed the node's lease (frozen, or cut off from Redis): the
            # control plane may be writing the node off and placing this replica's work elsewhere,
            # so it takes nothing until the lease is back. What it runs now still ends here.
            if not self.paused:
                log.warning("%s; pausing", exc)
                self.paused = True
            if timeout > 0:  # idle: look again shortly; a batch in flight keeps stepping meanwhile
                self.stopped.wait(min(self.poll_s, 0.5))
            return None
        except Exception:
            log.exception("cannot take requests from the queue; retrying")
            self.stopped.wait(self.poll_s)
            return None

    def _resume(self) -> None:
        if self.paused:
            log.info("node %s's lease is held again: taking requests", self.node.node if self.node else "")
            self.paused = False

    def _chunk(self, request: Request, *, batched: bool = False) -> Callable[[str], None] | None:
        """What a streamed request's chunks go through, fenced as its end is: written at once, or,
        for a batched request, kept for the step's one write (`_send_chunks`)."""
        if not request.params.get("stream"):
            return None
        if batched:
            return lambda text: self.chunks.append((request.id, text))
        replica_id = self.host.replica_id
        return lambda text: self.queue.chunk(request.id, text, replica_id, self.host.fence, self.node)

    def _send_chunks(self) -> None:
        """The step's streamed tokens, in one round trip. A request given back meanwhile (its
        replica written off and the request handed to another) loses its piece, as its end will be
        refused; a fence that refuses them all stops the replica, as a refused end does."""
        pieces, self.chunks = self.chunks, []
        if not pieces:
            return
        try:
            self.queue.chunks(pieces, self.host.replica_id, self.host.fence, self.node)
        except NotTaken as exc:
            log.info("%s; its streamed text is dropped", exc)
        except Fenced as exc:
            self.host.on_stale(str(exc))
        except Exception:
            # Redis gone past the patient queue's wait (which told the host already): the pieces
            # are lost, the answers below are still tried, and the loop goes on to its end.
            log.warning("cannot write %d streamed piece(s)", len(pieces), exc_info=True)

    def _announce(self) -> None:
        with self._claim:
            # Checked under the lock `withdraw` takes after the host cleared it: either this claim
            # is made first and withdrawn there, or it sees the replica no longer takes requests.
            if self.live or not self.host.accepting.is_set():
                return
            try:
                self.live = self.queue.announce(self.deployment, self.family, self.host.replica_id)
            except Exception:  # the web asks the database instead; the next take tries again
                log.warning("cannot claim to take requests", exc_info=True)

    def withdraw(self) -> None:
        """The replica stops taking requests (drain, sleep, stop): withdraw its claim. Runs on the
        thread that changes the host's state, before that change is reported."""
        with self._claim:
            if not self.live:
                return
            self.live = False
            try:
                self.queue.withdraw(self.deployment, self.host.replica_id)
            except Exception:
                # The claim lapses within LIVE_TTL_S; the control plane also withdraws it when the
                # replica's report reaches it (scheduling.services.replicas).
                log.warning("cannot withdraw the claim to take requests", exc_info=True)

    def accept(self, request: Request) -> None:
        """A taken request: into the batch, or run at once where there is no pool."""
        if request.stop_asked:
            # Asked stopped while another replica held it, which then gave it back (it drained,
            # or died and was written off): it ends here, unrun.
            self._stopped(request, request.stop_asked)
            return
        paged = self.host.paged
        if (adapter := request.params.get(adapters.PARAM)) is not None and (paged is None or paged.adapters is None):
            # Spec changed under it: a request for an adapter this replica was not started with.
            if not self.host.begin_request():
                self.queue.give_back(request, self.host.replica_id)
                return
            self._fail(request, f"model: this replica serves no adapters, and the request names {adapter!r}", BAD_INPUT)
            return
        if request.kind in ("forward", "embed") or paged is None or request.params.get(COUNT_ONLY):
            self.serve(request)  # at once: a count generates nothing, and needs no room in the batch
            return
        if not self.host.begin_request():
            self.queue.give_back(request, self.host.replica_id)
            return
        on_chunk = self._chunk(request, batched=True)
        try:
            batch = self._batcher_for(paged)
            batch.submit(self._sequence(request, on_chunk, paged, adapter, batch))
        except BadInput as exc:
            self._fail(request, str(exc), exc.kind)
        except Exception as exc:
            log.exception("request %s failed", request.id)
            self._fail(request, " ".join(str(exc).split())[:500], "error")

    def _sequence(
        self,
        request: Request,
        on_chunk: Callable[[str], None] | None,
        paged: PagedModel,
        adapter: str | None,
        batch: Batcher,
    ) -> Sequence:
        """`request` as its sequence for `batch`: its adapter's row, its prefix cache's scope, and
        a conversation asked truncated (Responses' `truncation: auto`) cut to its fewest earliest
        turns that leave it room (gpuportal.wire.truncation). BadInput as the executor's."""
        executor = self.host.executor()
        salt = request.params.get(prefix_cache.CACHE_SALT)
        scope = prefix_cache.scope(request.owner, salt, self.host.prefix_cache)

        def made(asked: Request) -> Sequence:
            seq = executor.sequence(asked, on_chunk)
            seq.tag, seq.scope = request, scope  # the request as queued, whatever was cut
            if adapter is not None:
                seq.adapter = adapter_row(paged, adapter)
            return seq

        if request.params.get(truncation.TRUNCATION) != truncation.AUTO or not isinstance(request.input, list):
            return made(request)

        def fits(messages: list[dict[str, Any]]) -> bool:
            try:
                batch.check(made(dataclasses.replace(request, input=messages)))
            except TooLong:
                return False
            return True

        found = truncation.shortest_fit(request.input, fits)
        return made(request if found is None else dataclasses.replace(request, input=found[0]))

    def step(self) -> None:
        batch = self.batch
        assert batch is not None
        if self.host.abort.is_set():  # a drain's deadline: every sequence goes back, unfinished
            log.info("%d request(s) cut short by a drain; giving them back to the queue", len(batch.running))
            self._give_back(batch.abort_all())
            return
        if not self.host.accepting.is_set():
            # Draining: what has not started may as well wait in the queue, for another replica.
            self._give_back(batch.take_waiting())
        try:
            with self.host.lock:
                ended = batch.step()
        except Exception as exc:  # a bug or a broken queue: fail the batch rather than hang the drain
            log.exception("a batch step failed")
            self.starting.clear()
            error = " ".join(str(exc).split())[:500]
            for seq in batch.abort_all():
                self._fail(seq.tag, error, "error")
            self.chunks.clear()
            return
        # Before the ends: a stream's last piece must be there when its end says it is complete.
        self._send_chunks()
        for seq in ended:
            self._finish(seq)
        if self.starting:
            # Still running after their first step: `running` from here on, stamped when admitted.
            starting, self.starting = self.starting, {}
            try:
                self.queue.started(starting, self.host.replica_id)
            except Exception:  # only the status shown while it runs: its answer still lands
                log.warning("cannot mark %d request(s) running", len(starting), exc_info=True)

    def _finish(self, seq: Sequence) -> None:
        request: Request = seq.tag
        started_at = self.starting.pop(request.id, None)
        if seq.error is not None:
            # The caller's to fix where it is its input's (a format that cannot be held to).
            kind = seq.error.kind if isinstance(seq.error, BadInput) else "error"
            self._fail(request, " ".join(str(seq.error).split())[:500], kind)
            return
        output = echoed(self.host.tokenizer, request, seq.result())
        if request.kind == "chat":
            output["message"] = {"role": "assistant", "content": output["text"]}
        try:
            self._record(
                lambda fence: self.queue.finish(
                    request.id,
                    self.host.replica_id,
                    output,
                    fence,
                    started_at=started_at,
                    first_token_at=seq.first_token_at,
                    node=self.node,
                )
            )
        finally:
            self.host.end_request()

    def _asked(self) -> dict[str, str]:
        """The callers' asks to stop the requests this replica holds (id → why), read at most every
        STOPS_EVERY_S; {} between reads, or when Redis cannot say (asked again at the next read)."""
        if time.monotonic() - self.stops_read_at < STOPS_EVERY_S:
            return {}
        self.stops_read_at = time.monotonic()
        try:
            return self.queue.asked_stops(self.host.replica_id)
        except redis.RedisError:  # an ask kept in Redis is read once it is back; the batch goes on
            log.warning("cannot read the asks to stop requests", exc_info=True)
            return {}

    def _end_stopped(self, batch: Batcher) -> None:
        """End the batch's sequences whose callers asked them stopped, before its next step: their
        blocks go to the others, and what they generated until now is their answer."""
        asked = self._asked()
        if not asked:
            return
        for seq in batch.stop(lambda s: s.tag.id in asked):
            request: Request = seq.tag
            log.info("request %s stopped after %d token(s): %s", request.id, len(seq.generated), asked[request.id])
            try:
                self._stopped(
                    request, asked[request.id], seq.result(), self.starting.pop(request.id, None), seq.first_token_at
                )
            finally:
                self.host.end_request()

    def _stopped(
        self,
        request: Request,
        why: str,
        output: dict[str, Any] | None = None,
        started_at: float | None = None,
        first_token_at: float | None = None,
    ) -> None:
        """Write a request's end as its caller asked: `cancelled`, with what it generated here."""
        replica_id = self.host.replica_id
        self._record(
            lambda fence: self.queue.stopped(
                request.id,
                replica_id,
                why,
                output,
                fence,
                self.node,
                started_at=started_at,
                first_token_at=first_token_at,
            )
        )

    def _batcher_for(self, paged: PagedModel) -> Batcher:
        from inference.batching import Batcher, eos_ids

        if self.batch is None or self.batch.engine is not paged:
            # A new pool (after a wake): the old batch is empty, a drain saw to that.
            assert self.batch is None or self.batch.idle, "a new KV pool under a running batch"
            self.batch = Batcher(
                paged,
                self.host.tokenizer,
                eos_ids(paged.model),
                on_start=self._admitted,
                prefix_cache=self.host.prefix_cache != prefix_cache.OFF,
            )
        return self.batch

    def _admitted(self, seq: Sequence) -> None:
        # Not written yet: a short request ends within the step that admits it, and its start
        # then travels with its answer, saving the replica a round trip per request.
        self.starting[seq.tag.id] = time.time()

    def _give_back(self, sequences: list[Sequence]) -> None:
        for seq in sequences:  # newest first: the oldest ends at the head of the queue
            try:
                self.queue.give_back(seq.tag, self.host.replica_id)
            finally:
                self.host.end_request()

    def _fail(self, request: Request, reason: str, kind: str) -> None:
        try:
            self._record(
                lambda fence: self.queue.fail(request.id, self.host.replica_id, reason, kind, fence, self.node)
            )
        finally:
            self.host.end_request()

    def serve(self, request: Request) -> None:
        if not self.host.begin_request():
            # Taken just as the replica began to sleep or stop: back to the head of the queue.
            self.queue.give_back(request, self.host.replica_id)
            return
        # Counted in flight from here: a drain waits for end_request, which comes only once the
        # outcome is in the queue, so a replica that reports `sleeping` holds no request.
        try:
            with self.host.lock:
                self._run(request)
        finally:
            self.host.end_request()

    def _run(self, request: Request) -> None:
        if self.host.abort.is_set():  # the drain's deadline passed before it could start
            self.queue.give_back(request, self.host.replica_id)
            return
        self.queue.start(request.id, self.host.replica_id)
        on_chunk = self._chunk(request)
        why: list[str] = []  # why its caller asked it stopped, once asked

        def asked() -> bool:
            if (asked_why := self._asked().get(request.id)) is not None:
                why.append(asked_why)
            return bool(why)

        try:
            output = self.host.executor().run(request, on_chunk, asked)
        except Aborted:
            log.info("request %s cut short by a drain; giving it back to the queue", request.id)
            self.queue.give_back(request, self.host.replica_id)
            return
        except BadInput as exc:
            reason, kind = str(exc), exc.kind
            self._record(
                lambda fence: self.queue.fail(request.id, self.host.replica_id, reason, kind, fence, self.node)
            )
            return
        except Exception as exc:
            log.exception("request %s failed", request.id)
            error = " ".join(str(exc).split())[:500]
            self._record(
                lambda fence: self.queue.fail(request.id, self.host.replica_id, error, "error", fence, self.node)
            )
            return
        if why and output.get("finish_reason") == STOPPED:
            self._stopped(request, why[0], output)
            return
        self._record(lambda fence: self.queue.finish(request.id, self.host.replica_id, output, fence, node=self.node))

    def _record(self, write: Callable[[Any], None]) -> None:
        """Write an outcome, fenced by the failover epoch if the replica is a pair member: a member
        whose epoch was superseded has its result refused, and stops (the request stays taken, and
        its agent gives it back to the queue for the pair's new active member). Any replica's
        result is refused for a request it no longer holds: the control plane wrote the replica off
        (its node went silent) and gave its requests back; it stops too, as its agent would have
        it do once it is heard again."""
        try:
            write(self.host.fence)
        except Fenced as exc:
            self.host.on_stale(str(exc))


def adapter_row(paged: PagedModel, name: str) -> int:
    """The adapter's row in the engine's stacks; BadInput naming `model` where it serves none of that name."""
    assert paged.adapters is not None
    try:
        return paged.adapters.index(name)
    except ValueError as exc:
        raise BadInput(f"model: {exc}") from None


class KvPublisher:
    """Puts the replica's KV pool figures where the control plane reads them (gpuportal.wire.kvstats):
    when they change (at most once a second), and at least every REFRESH_S while there is a pool,
    so they never expire under a live replica; a replica without a pool (asleep) stops publishing
    and its key expires."""

    REFRESH_S = 5.0
    # Every request changes the figures (allocations, frees): publishing each change would put a
    # Redis round trip in front of every next request, for a dashboard that refreshes every 3 s.
    AT_MOST_EVERY_S = 1.0

    def __init__(self, host: ServingHost, queue: RequestQueue):
        self.host, self.queue = host, queue
        self.last: dict[str, Any] | None = None
        self.at = 0.0

    def publish(self) -> None:
        stats = self.host.kv_stats()
        since = time.monotonic() - self.at
        if stats is None or since < (self.REFRESH_S if stats == self.last else self.AT_MOST_EVERY_S):
            return
        try:
            kvstats.publish(self.queue.redis, self.host.replica_id, stats)
        except Exception:  # figures for a dashboard: never worth stopping the serving loop for
            log.warning("cannot publish the KV pool figures", exc_info=True)
            return
        self.last, self.at = stats, time.monotonic()
