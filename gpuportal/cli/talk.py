"""Talking to models from the command line, as `ollama run` and `ollama ps` users do: `run` (one
answer, streamed to stdout as it is generated, so it pipes), `chat` (a conversation with its
history), `embed` (one JSON vector a line), `rerank` (documents by relevance to a query), `ps`
(what is loaded where). Through `/v1`, as
OpenAI's clients call the portal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuportal.cli import chatting, config, render
from gpuportal.cli.client import ApiError, Client, CliError
from gpuportal.cli.options import JSON, add_output_option, positive_int, print_json
from gpuportal.cli.waiting import Goal, wait_for
from gpuportal.wire import sampling
from gpuportal.wire.states import ENDED
from gpuportal.wire.states import ReplicaState as S

# What `run` and `chat` ask for when not told: a whole answer rather than the API's 16 tokens,
# but never more than half a replica's KV cache, so that a prompt has the other half: a replica
# refuses a prompt plus max_tokens that its cache cannot hold (a deployment of 256 tokens
# refused every `run` that did not set --max-tokens).
DEFAULT_MAX_TOKENS = 256
# Each call's own limit on the portal (a cold model may load first: the portal's most).
TIMEOUT_S = 300.0
CHAT_COMMANDS = "/exit (or Ctrl-D) ends, /clear forgets the conversation, /? lists the others"


# OpenAI's code for a prompt plus max_tokens past what the model (here: the replica) holds.
TOO_LONG = "context_length_exceeded"


class Refused(CliError):
    """A streamed call that ended with an error event: its message, and OpenAI's code if it had one."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class Figures:
    """What `--verbose` says of an answer (as `ollama run --verbose`): when it was asked, when its
    first piece and its end came (time.monotonic()), and the usage the portal counted."""

    asked: float = field(default_factory=time.monotonic)
    first: float | None = None
    ended: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        ended = self.ended if self.ended is not None else time.monotonic()
        said = [f"total duration:       {ended - self.asked:.3f} s"]
        if self.first is not None:
            said.append(f"time to first token:  {self.first - self.asked:.3f} s")
        prompt, made = self.usage.get("prompt_tokens"), self.usage.get("completion_tokens")
        if prompt is not None:
            cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            said.append(f"prompt tokens:        {prompt}" + (f" ({cached} from the prefix cache)" if cached else ""))
        if made is not None:
            rate = ""
            # The tokens after the first, over the time after the first: the decode rate.
            if self.first is not None and made > 1 and ended > self.first:
                rate = f" ({(made - 1) / (ended - self.first):.1f} tokens/s)"
            said.append(f"output tokens:        {made}{rate}")
        return said


class Talker(Protocol):
    """What these commands use of the command line's context (gpuportal.cli.app.Context)."""

    env: Any
    out: Console
    err: Console

    @property
    def client(self) -> Client: ...


def cmd_run(ctx: Talker, args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt not in (None, "-") else sys.stdin.read()
    if not prompt.strip():
        raise CliError('run: no prompt: give it after the model (`gpuportal run tiny "Hello"`) or on stdin')
    if args.source:
        deployed(ctx, args.model, args.source, args.timeout)
    body = {"model": args.model, "prompt": prompt, **_sampling(ctx, args)}
    write = _writer(ctx.out)
    figures = Figures() if args.verbose else None
    try:
        text = "".join(stream(ctx.client, "/v1/completions", body, write, figures=figures))
    except KeyboardInterrupt:
        # The stream is closed as this unwinds, and the portal stops generating for nobody.
        write("\n")
        ctx.err.print(Text("interrupted: the answer was stopped", style="bright_black"))
        return 130
    if not text.endswith("\n"):
        write("\n")
    _report(ctx, figures)
    return 0


def _report(ctx: Talker, figures: Figures | None) -> None:
    """An answer's figures on stderr (`--verbose`), so that stdout keeps the answer alone."""
    if figures is not None:
        for line in figures.lines():
            ctx.err.print(Text(line, style="bright_black"))


def cmd_chat(ctx: Talker, args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    session = chatting.Session(args.system, _sampling(ctx, args), verbose=args.verbose)
    history = session.start()
    write = _writer(ctx.out)
    if interactive:
        ctx.err.print(Text(f"chatting with {args.model}: {CHAT_COMMANDS}", style="bright_black"))
    while True:
        try:
            line = chatting.read_message(input, ">>> " if interactive else "", "... " if interactive else "")
        except EOFError:
            break
        said = line.strip()
        if not said:
            continue
        if chatting.is_command(said):
            done = chatting.run(session, said)
            if done.end:
                break
            if done.forget:
                history = session.start()
            if done.said:
                ctx.err.print(Text(done.said, style="bright_black"))
            continue
        figures = Figures() if session.verbose else None
        try:
            kept = len(session.start())
            reply = _reply(ctx, args.model, history, line, session.asked, write, kept=kept, figures=figures)
        except KeyboardInterrupt:
            if not interactive:
                raise
            # Ctrl-C stops the answer, as in `ollama run`: its stream is closed, so the portal
            # stops generating it, and the conversation goes on without that turn.
            write("\n")
            ctx.err.print(Text("(stopped: that turn is left out of the conversation)", style="bright_black"))
            continue
        except CliError as error:
            if not interactive:
                raise  # a script learns of it by the exit status
            # The conversation is kept, less the turn that failed: a refusal (the conversation
            # grown past the replica's KV cache, a model asleep past the call's timeout) need not
            # end it.
            ctx.err.print(Text(f"error: {error}", style="red"))
            ctx.err.print(Text(f"that turn is left out of the conversation: {CHAT_COMMANDS}", style="bright_black"))
            continue
        write("\n" if not reply.endswith("\n") else "")
        _report(ctx, figures)
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
    return 0


def _reply(
    ctx: Talker,
    model: str,
    history: list[dict[str, str]],
    line: str,
    asked: dict[str, Any],
    write: Callable[[str], None],
    *,
    kept: int,
    figures: Figures | None = None,
) -> str:
    """The model's answer to `line` after `history`. A conversation grown past the replica's KV
    cache loses its oldest turns (the first `kept` messages, a system message, stay), each said on
    stderr, until it fits, as `ollama run` shifts its context; `history` is trimmed in place."""
    while True:
        body = {"model": model, "messages": [*history, {"role": "user", "content": line}], **asked}
        try:
            return "".join(stream(ctx.client, "/v1/chat/completions", body, write, _thinker(ctx.err), figures=figures))
        except Refused as refused:
            if refused.code != TOO_LONG or len(history) <= kept:
                raise
        # The oldest exchange: a user's turn and the answer to it.
        del history[kept : kept + 2]
        ctx.err.print(
            Text("(the oldest turn is left out: the conversation outgrew the replica's KV cache)", style="bright_black")
        )


def cmd_embed(ctx: Talker, args: argparse.Namespace) -> int:
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise CliError("embed: no text: give them after the model, or one a line on stdin")
    answer = ctx.client.post("/v1/embeddings", {"model": args.model, "input": texts, "timeout": args.timeout})
    for item in sorted(answer.get("data", []), key=lambda d: d.get("index", 0)):
        ctx.out.file.write(json.dumps(item["embedding"]) + "\n")
    return 0


def cmd_rerank(ctx: Talker, args: argparse.Namespace) -> int:
    documents = args.documents or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not documents:
        raise CliError("rerank: no document: give them after the query, or one a line on stdin")
    asked = {"model": args.model, "query": args.query, "documents": documents, "timeout": args.timeout}
    if args.top is not None:
        asked["top_n"] = args.top
    answer = ctx.client.post("/v1/rerank", {**asked, "return_documents": False})
    for result in answer.get("results", []):  # the most relevant first, as the portal ranks them
        ctx.out.file.write(f"{result['relevance_score']:.4f}\t{documents[result['index']]}\n")
    return 0


def cmd_ps(ctx: Talker, args: argparse.Namespace) -> int:
    replicas = [r for r in ctx.client.pages("/api/replicas/") if r.get("state") != S.STOPPED]
    if args.model:
        replicas = [r for r in replicas if r.get("deployment") == args.model]
    if args.output == JSON:
        print_json(ctx.out, replicas)
        return 0
    if not replicas:
        ctx.out.print("nothing is loaded; `gpuportal run MODEL PROMPT --source DIR` loads one and asks it")
        return 0
    ctx.out.print(ps_table(replicas))
    return 0


def ps_table(replicas: list[dict[str, Any]]) -> Table:
    """Each replica: its model, whether it is awake, where, the GPU memory it holds, how long since
    its last use (as `ollama ps` and `docker ps` say an age), and its KV cache: the blocks its
    requests hold of all it has, those its prefix cache keeps, and how many prompt tokens it found.
    A failover pair holds one reservation, counted on the row of the member that holds it; the
    other member's row names that one instead of showing the same bytes twice. A failed replica
    holds nothing."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("MODEL", "REPLICA", "STATE", "ON", "GPU MEMORY", "LAST USED", "KV BLOCKS"):
        table.add_column(column, overflow="fold")
    holders = {
        (r.get("deployment"), pair["pair"]): r["id"]
        for r in replicas
        if (pair := r.get("failover_state") or {}).get("holder") and "pair" in pair
    }
    for replica in sorted(replicas, key=lambda r: (r.get("deployment") or "", r["id"])):
        state = replica.get("state", "?")
        held = sum((replica.get("gpu_mem_bytes_by_id") or {}).values())
        pair = replica.get("failover_state") or {}
        holder = None if pair.get("holder") else holders.get((replica.get("deployment"), pair.get("pair")))
        if state in ENDED:
            memory = "-"
        else:
            memory = f"in {render.short_id(holder)}'s" if holder else render.human_bytes(held) if held else "-"
        table.add_row(
            Text(replica.get("deployment") or "?"),
            render.short_id(replica["id"]),
            Text(state, style=render.STATE_STYLES.get(state, "")),
            Text(render.placement(replica)),
            memory,
            render.since(replica.get("last_accessed")),
            _kv(replica.get("kv")),
        )
    return table


def _kv(kv: Any) -> str:
    """A replica's KV figures (its `kv`: gpuportal.wire.kvstats) in a few words; "-" for none."""
    if not isinstance(kv, dict) or not kv.get("blocks_total"):
        return "-"
    said = f"{kv.get('blocks_used', 0)}/{kv['blocks_total']}"
    if kv.get("blocks_cached"):
        said += f" +{kv['blocks_cached']} cached"
    if kv.get("prefix_queried"):
        said += f", {100 * kv.get('prefix_hits', 0) // kv['prefix_queried']}% hit"
    return said


def stream(
    client: Client,
    path: str,
    body: dict[str, Any],
    write: Callable[[str], None],
    think: Callable[[str], None] | None = None,
    *,
    figures: Figures | None = None,
) -> list[str]:
    """A streamed /v1 call: each piece of text written as it arrives, and of a chat's reasoning
    (a reasoning model's thinking) handed to `think`; the pieces of text. `figures`, where given,
    learns when the first piece and the end came and what the portal counted (its last chunk's
    `usage`)."""
    pieces: list[str] = []
    for event in client.events(path, {**body, "stream": True}):
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {"message": event["error"]}
            raise Refused(str(error.get("message") or error), error.get("code"))
        if figures is not None and isinstance(usage := event.get("usage"), dict):
            figures.usage = usage
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if think is not None and (thought := delta.get("reasoning")):
                think(thought)
            piece = choice.get("text") if "text" in choice else delta.get("content")
            if figures is not None and figures.first is None and (piece or delta.get("reasoning")):
                figures.first = time.monotonic()
            if piece:
                write(piece)
                pieces.append(piece)
    if figures is not None:
        figures.ended = time.monotonic()
    return pieces


def deployed(ctx: Talker, name: str, source: str, timeout_s: float) -> None:
    """Deploy `source` as `name` unless a deployment of that name exists, waiting (with its
    progress) until it serves."""
    try:
        ctx.client.get(f"/api/deployments/{quote(name, safe='')}/")
        return
    except ApiError as err:
        if err.status != 404:
            raise
    ctx.err.print(Text(f"{name} is not deployed: deploying {source}"))
    body = {"name": name, "model": {"source": config.model_source(source)}, "replicas": 1}
    answer = ctx.client.post("/api/deployments/", body)
    wait_for(ctx.client, answer, Goal(S.SERVING, 1, at_least=True), console=ctx.err, timeout_s=timeout_s)


def _sampling(ctx: Talker, args: argparse.Namespace) -> dict[str, Any]:
    max_tokens = args.max_tokens
    if max_tokens is None:
        capacity = kv_capacity(ctx.client, args.model)
        max_tokens = DEFAULT_MAX_TOKENS if capacity is None else max(1, min(DEFAULT_MAX_TOKENS, capacity // 2))
    given = {name: value for name in CLI_SAMPLING if (value := getattr(args, name)) is not None}
    if args.format == "json":  # as `ollama run --format json`: the answer is held to a JSON object
        given["response_format"] = {"type": "json_object"}
    return {"max_tokens": max_tokens, "temperature": args.temperature, **given, "timeout": args.timeout}


def kv_capacity(client: Client, name: str) -> int | None:
    """The tokens the smallest KV cache among the deployment's replicas holds (a replica's
    `kv`, else the deployment's `memory.max_tokens`, what its replicas are sized for); None
    where neither is known, or there is no such deployment (the /v1 call then says so)."""
    try:
        deployment = client.get(f"/api/deployments/{quote(name, safe='')}/")
    except ApiError as err:
        if err.status == 404:
            return None
        raise
    if not isinstance(deployment, dict):
        return None
    held = [
        kv["blocks_total"] * kv["block_tokens"]
        for replica in deployment.get("replicas") or []
        if replica.get("state") not in ENDED and isinstance(kv := replica.get("kv"), dict) and kv.get("blocks_total")
    ]
    if held:
        return min(held)
    sized = (deployment.get("memory") or {}).get("max_tokens")
    return sized if isinstance(sized, int) and sized > 0 else None


def _writer(console: Console) -> Callable[[str], None]:
    """Text as it comes, unwrapped and unstyled, flushed at once: what a pipe or a terminal reads."""
    out = console.file

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write


def _thinker(console: Console) -> Callable[[str], None]:
    """A reasoning model's thinking as it comes, on stderr (grey on a terminal), as `ollama run`
    shows it: there while it thinks, and never in what a script reads of the answer on stdout."""
    out = console.file

    def think(text: str) -> None:
        out.write(f"\x1b[90m{text}\x1b[0m" if console.is_terminal else text)
        out.flush()

    return think


def _number(kind: Callable[[str], float], *, least: float, strict: bool) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` at least `least` (more than it, `strict`), or a
    one-line error naming what was given, before anything is sent."""
    bound = f"more than {least:g}" if strict else f"{least:g} or more"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {'whole number' if kind is int else 'number'}: {text!r}") from None
        if value < least or (strict and value == least) or value != value:  # NaN too
            raise argparse.ArgumentTypeError(f"must be {bound}, not {text}")
        return value

    return parse


SECONDS = _number(float, least=0, strict=True)
# The sampling parameters `run` and `chat` take beside --temperature (gpuportal.wire.sampling).
CLI_SAMPLING = (
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "seed"
)  # fmt: skip


def _sampling_param(name: str) -> Callable[[str], Any]:
    """An argparse type for the sampling parameter `name`, held to its bounds before anything is sent."""
    param = sampling.BY_NAME[name]

    def parse(text: str) -> Any:
        try:
            return param.read(text)
        except ValueError as why:
            raise argparse.ArgumentTypeError(str(why)) from None

    return parse


def add_talking(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def sampling_options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--max-tokens",
            type=_number(int, least=1, strict=False),
            default=None,
            help=f"longest answer (default {DEFAULT_MAX_TOKENS}, or half the replica's KV cache where that is less)",
        )
        parser.add_argument(
            "--temperature",
            type=_number(float, least=0, strict=False),
            default=0.0,
            help="0 (default): the likeliest each time",
        )
        for name in CLI_SAMPLING:
            param = sampling.BY_NAME[name]
            parser.add_argument(f"--{name.replace('_', '-')}", type=_sampling_param(name), help=param.help)
        parser.add_argument(
            "--format",
            choices=("json",),
            help="json: the answer is held to a JSON object as it is generated (as ollama's --format json)",
        )
        parser.add_argument("--timeout", type=SECONDS, default=TIMEOUT_S, help=f"seconds (default {TIMEOUT_S:.0f})")
        parser.add_argument(
            "--verbose",
            action="store_true",
            help="after each answer, on stderr: its time to first token, its prompt tokens (those the replica's "
            "prefix cache held) and its output tokens a second (as ollama's --verbose)",
        )

    run = commands.add_parser("run", help="ask a model once; the answer streams to stdout")
    run.add_argument("model", help="the deployment's name")
    run.add_argument("prompt", nargs="?", help="the prompt (default, or `-`: stdin)")
    run.add_argument("--source", help="deploy this model directory (or hf:org/name) as MODEL first, if it is not")
    sampling_options(run)
    run.set_defaults(run=cmd_run)

    chat = commands.add_parser("chat", help=f"talk with a model, keeping the conversation ({CHAT_COMMANDS})")
    chat.add_argument("model", help="the deployment's name")
    chat.add_argument("--system", help="a system message that starts the conversation")
    sampling_options(chat)
    chat.set_defaults(run=cmd_chat)

    embed = commands.add_parser("embed", help="embed texts: one JSON vector a line")
    embed.add_argument("model", help="an embedding deployment's name")
    embed.add_argument("texts", nargs="*", help="the texts (default: one a line on stdin)")
    embed.add_argument("--timeout", type=SECONDS, default=TIMEOUT_S, help=f"seconds (default {TIMEOUT_S:.0f})")
    embed.set_defaults(run=cmd_embed)

    rerank = commands.add_parser(
        "rerank", help="rank documents by their relevance to a query: a line each, the most relevant first, its score"
    )
    rerank.add_argument("model", help="an embedding deployment's name")
    rerank.add_argument("query", help="what the documents are ranked by")
    rerank.add_argument("documents", nargs="*", help="the documents (default: one a line on stdin)")
    rerank.add_argument("--top", type=positive_int, help="only the best N")
    rerank.add_argument("--timeout", type=SECONDS, default=TIMEOUT_S, help=f"seconds (default {TIMEOUT_S:.0f})")
    rerank.set_defaults(run=cmd_rerank)

    ps = commands.add_parser("ps", help="what is loaded where: each replica awake or asleep, its memory, its last use")
    ps.add_argument("model", nargs="?", help="only this deployment's replicas")
    add_output_option(ps, "the replicas that have not stopped")
    ps.set_defaults(run=cmd_ps)
