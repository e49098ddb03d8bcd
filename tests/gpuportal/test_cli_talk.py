"""Talking to models from the command line (`run`, `chat`, `embed`, `ps`), against a portal that
answers as the real one does on /v1 (server-sent events, OpenAI's error shape) and /api. The
real portal's /v1 is tested in tests/scheduling/test_openai.py; this is what the commands make of
its answers."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gpuportal.cli import app, talk
from tests.support.api_shapes import shaped

# The fake's "KV cache": a chat whose messages hold more characters is refused as too long.
CONTEXT_CHARACTERS = 45
# What the fake counts of every answer: 2 of its 4 prompt tokens held by the prefix cache.
USAGE = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}}
SERVING = {"id": "b" * 32, "deployment": "tiny", "state": "serving", "node": "box", "gpu_indexes": [0]}


class FakePortal(ThreadingHTTPServer):
    """/v1 completions and chat stream their answer in pieces (chat echoes what it was sent,
    upper-cased); /v1/embeddings answers one vector per input; /api knows `deployed`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.deployed: dict[str, dict[str, Any]] = {}
        portal = self

        class Handler(BaseHTTPRequestHandler):
            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length)) if length else None

            def _json(self, status: int, body: Any) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _events(self, pieces: list[dict[str, Any]]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(b": waiting for tiny to wake\n\n")
                for piece in pieces:
                    self.wfile.write(f"data: {json.dumps(piece)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

            def do_POST(self) -> None:
                body = self._body()
                portal.calls.append(("POST", self.path, body))
                if self.path == "/v1/completions":
                    if body["model"] not in portal.deployed:
                        self._json(404, {"error": {"message": f"The model `{body['model']}` does not exist"}})
                        return
                    pieces = [{"choices": [{"text": t}]} for t in ("Once", " upon", " a time")]
                    pieces[-1]["usage"] = USAGE  # as the portal's last chunk carries it
                    self._events(pieces)
                elif self.path == "/v1/chat/completions":
                    if body["messages"][-1]["content"] == "too long":
                        refusal = "input too long for this replica's KV cache: 300 prompt tokens plus max_tokens 256"
                        self._json(400, {"error": {"message": refusal, "type": "invalid_request_error"}})
                        return
                    if sum(len(m["content"]) for m in body["messages"]) > CONTEXT_CHARACTERS:
                        # As the portal ends a stream whose prompt its replica cannot hold.
                        too_long = {"message": "input too long for this replica's KV cache", "type":
                                    "invalid_request_error", "code": "context_length_exceeded"}  # fmt: skip
                        self._events([{"error": too_long}])
                        return
                    said = body["messages"][-1]["content"].upper()
                    if said == "PONDER":  # as a reasoning model's thinking streams, then its answer
                        thinking = [{"choices": [{"delta": {"reasoning": w, "reasoning_content": w}}]} for w in "Hm."]
                        self._events([*thinking, {"choices": [{"delta": {"content": "Yes."}}]}])
                        return
                    pieces = [{"choices": [{"delta": {"content": w}}]} for w in (said[:2], said[2:])]
                    self._events([*pieces[:-1], {**pieces[-1], "usage": USAGE}])
                elif self.path == "/v1/rerank":
                    # As the portal ranks: here the longest document first, scored by its length.
                    ranked = sorted(enumerate(body["documents"]), key=lambda d: -len(d[1]))[: body.get("top_n")]
                    results = [{"index": i, "relevance_score": len(d) / 10} for i, d in ranked]
                    self._json(200, {"id": "rerank-1", "model": body["model"], "results": results})
                elif self.path == "/v1/embeddings":
                    vectors = [{"index": i, "embedding": [float(len(t)), 0.5]} for i, t in enumerate(body["input"])]
                    self._json(200, {"data": vectors[::-1]})
                elif self.path == "/api/deployments/":
                    deployment = {"name": body["name"], "replicas_wanted": 1, "replicas": [SERVING]}
                    deployment = shaped("Deployment", deployment)
                    portal.deployed[body["name"]] = deployment
                    self._json(201, deployment)

            def do_GET(self) -> None:
                portal.calls.append(("GET", self.path, None))
                if self.path.startswith("/api/replicas/"):
                    replicas = [
                        {**SERVING, "gpu_mem_bytes_by_id": {"0": 2 * 1024**3}, "last_accessed": None},
                        {**SERVING, "id": "c" * 32, "deployment": "big", "state": "sleeping", "node": "box"},
                        {**SERVING, "id": "d" * 32, "state": "stopped"},
                    ]
                    replicas = [shaped("Replica", r) for r in replicas]
                    self._json(200, {"results": replicas, "next": None})
                    return
                name = self.path.removeprefix("/api/deployments/").strip("/")
                if name in portal.deployed:
                    self._json(200, portal.deployed[name])
                else:
                    self._json(404, {"detail": f"no deployment named {name!r}"})

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def env(self) -> dict[str, str]:
        return {"GPUPORTAL_URL": f"http://127.0.0.1:{self.server_address[1]}", "GPUPORTAL_TOKEN": "t"}


@pytest.fixture
def portal() -> Iterator[FakePortal]:
    server = FakePortal()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def stdin(monkeypatch, text: str, *, terminal: bool = False) -> None:
    monkeypatch.setattr("sys.stdin", (Terminal if terminal else io.StringIO)(text))


def test_run_streams_the_answer_to_stdout_and_asks_for_a_whole_answer(portal, capsys):
    portal.deployed["tiny"] = {}

    assert app.main(["run", "tiny", "Tell me a story", "--temperature", "0.5"], env=portal.env) == 0

    assert capsys.readouterr().out == "Once upon a time\n"
    (_, path, body) = portal.calls[-1]
    assert path == "/v1/completions"
    assert body == {
        "model": "tiny", "prompt": "Tell me a story", "max_tokens": 256, "temperature": 0.5, "timeout": 300.0,
        "stream": True,
    }  # fmt: skip


def test_verbose_says_each_answers_figures_on_stderr_and_leaves_stdout_the_answer(portal, capsys, monkeypatch):
    portal.deployed["tiny"] = {}

    assert app.main(["run", "tiny", "Tell me a story", "--verbose"], env=portal.env) == 0
    ran = capsys.readouterr()
    stdin(monkeypatch, "hi\n/set verbose\nyo\n/set quiet\nhey\n")
    assert app.main(["chat", "tiny"], env=portal.env) == 0
    chatted = capsys.readouterr()

    assert ran.out == "Once upon a time\n"
    assert "prompt tokens:        4 (2 from the prefix cache)" in ran.err and "output tokens:        3" in ran.err
    assert "time to first token:" in ran.err and "total duration:" in ran.err
    assert chatted.err.count("prompt tokens:") == 1, "said after the turn asked verbose alone"
    assert "figures are said from the next turn on" in chatted.err


def test_the_figures_are_the_times_and_the_portals_counts():
    from gpuportal.cli.talk import Figures

    figures = Figures(asked=10.0, first=10.25, ended=11.25, usage=USAGE)
    assert figures.lines() == [
        "total duration:       1.250 s",
        "time to first token:  0.250 s",
        "prompt tokens:        4 (2 from the prefix cache)",
        "output tokens:        3 (2.0 tokens/s)",
    ]
    nothing_cached = Figures(asked=0.0, first=None, ended=0.5, usage={"prompt_tokens": 4, "completion_tokens": 0})
    said = ["total duration:       0.500 s", "prompt tokens:        4", "output tokens:        0"]
    assert nothing_cached.lines() == said, "no first token: no time to it, nor a rate"


def test_format_json_asks_for_a_json_object_as_ollamas_does(portal, capsys, monkeypatch):
    portal.deployed["tiny"] = {}
    stdin(monkeypatch, "hi\n")

    assert app.main(["run", "tiny", "Tell me a story", "--format", "json"], env=portal.env) == 0
    assert app.main(["chat", "tiny", "--format", "json"], env=portal.env) == 0

    sent = [body for _, path, body in portal.calls if path.startswith("/v1/")]
    assert [body["response_format"] for body in sent] == [{"type": "json_object"}] * 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        app.main(["run", "tiny", "x", "--format", "yaml"], env=portal.env)
    assert "invalid choice: 'yaml'" in capsys.readouterr().err


def test_run_sends_the_sampling_parameters_it_is_given_and_no_others(portal, capsys):
    portal.deployed["tiny"] = {}
    argv = ["run", "tiny", "Hi", "--seed", "7", "--top-k", "40", "--repetition-penalty", "1.1", "--min-p", "0"]

    assert app.main(argv, env=portal.env) == 0

    body = portal.calls[-1][2]
    assert {key: body[key] for key in body.keys() - {"model", "prompt", "max_tokens", "timeout", "stream"}} == {
        "temperature": 0.0,
        "seed": 7,
        "top_k": 40,
        "repetition_penalty": 1.1,
        "min_p": 0.0,
    }


def test_run_reads_the_prompt_from_stdin_so_that_it_pipes(portal, capsys, monkeypatch):
    portal.deployed["tiny"] = {}
    stdin(monkeypatch, "a prompt\nof two lines\n")

    assert app.main(["run", "tiny"], env=portal.env) == 0

    assert portal.calls[-1][2]["prompt"] == "a prompt\nof two lines\n"
    assert capsys.readouterr().out == "Once upon a time\n"


def test_run_of_a_model_that_is_not_deployed_says_so_and_exits_1(portal, capsys):
    assert app.main(["run", "nope", "Hi"], env=portal.env) == 1

    assert capsys.readouterr().err.splitlines() == ["error: The model `nope` does not exist"]


def test_run_with_a_source_deploys_the_model_first_when_it_is_not_and_then_asks_it(portal, capsys, tmp_path):
    model = tmp_path / "tiny-model"
    model.mkdir()

    assert app.main(["run", "tiny", "Hi", "--source", str(model)], env=portal.env) == 0
    assert app.main(["run", "tiny", "Hi again", "--source", str(model)], env=portal.env) == 0

    posts = [(path, body) for method, path, body in portal.calls if method == "POST"]
    assert posts[0] == ("/api/deployments/", {"name": "tiny", "model": {"source": str(model)}, "replicas": 1})
    assert [path for path, _ in posts[1:]] == ["/v1/completions", "/v1/completions"], "deployed once"
    out, err = capsys.readouterr()
    assert out == "Once upon a time\n" * 2 and "tiny is not deployed: deploying" in err


def test_a_run_without_a_prompt_is_refused_before_anything_is_sent(portal, capsys, monkeypatch):
    stdin(monkeypatch, "  \n")

    assert app.main(["run", "tiny"], env=portal.env) == 1

    assert "no prompt" in capsys.readouterr().err and portal.calls == []


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "tiny", "hi", "--max-tokens", "0"], "argument --max-tokens: must be 1 or more, not 0"),
        (["run", "tiny", "hi", "--max-tokens", "many"], "argument --max-tokens: not a whole number: 'many'"),
        (["chat", "tiny", "--temperature", "-1"], "argument --temperature: must be 0 or more, not -1"),
        (["embed", "e", "x", "--timeout", "0"], "argument --timeout: must be more than 0, not 0"),
        (["run", "tiny", "hi", "--timeout", "nan"], "argument --timeout: must be more than 0, not nan"),
        (["run", "tiny", "hi", "--top-k", "1.5"], "argument --top-k: not a whole number: '1.5'"),
        (["chat", "tiny", "--presence-penalty", "3"], "argument --presence-penalty: must be from -2 to 2, not 3"),
        (["run", "tiny", "hi", "--top-p", "0"], "argument --top-p: must be above 0 and at most 1, not 0"),
    ],
)
def test_a_sampling_setting_out_of_range_is_a_one_line_error_before_anything_is_sent(portal, capsys, argv, said):
    with pytest.raises(SystemExit) as exited:
        app.main(argv, env=portal.env)

    assert exited.value.code == 2 and said in capsys.readouterr().err and portal.calls == []


def test_chat_keeps_the_conversation_forgets_it_on_clear_and_ends_on_exit(portal, capsys, monkeypatch):
    stdin(monkeypatch, "hello\nhow are you\n/clear\nagain\n/exit\nnot sent\n")

    assert app.main(["chat", "tiny", "--system", "be brief"], env=portal.env) == 0

    assert capsys.readouterr().out == "HELLO\nHOW ARE YOU\nAGAIN\n"
    sent = [body["messages"] for method, path, body in portal.calls if path == "/v1/chat/completions"]
    assert sent == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "HELLO"},
            {"role": "user", "content": "how are you"},
        ],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "again"}],
    ]


def test_a_reasoning_models_thinking_shows_on_stderr_and_stays_out_of_the_answer_and_the_conversation(
    portal, capsys, monkeypatch
):
    stdin(monkeypatch, "ponder\nagain\n")

    assert app.main(["chat", "tiny"], env=portal.env) == 0

    shown = capsys.readouterr()
    assert shown.out == "Yes.\nAGAIN\n" and "Hm." in shown.err
    sent = [body["messages"] for method, path, body in portal.calls if path == "/v1/chat/completions"]
    assert sent[1][1] == {"role": "assistant", "content": "Yes."}


def test_chat_commands_change_how_it_is_asked_from_the_next_turn_as_ollamas_do(portal, capsys, monkeypatch):
    stdin(
        monkeypatch,
        "hello\n/set temperature 0.7\n/set max_tokens 5\n/set top_k 1.5\n/set system Be brief.\n/show\n"
        "/frobnicate\nagain\n",
    )

    assert app.main(["chat", "tiny"], env=portal.env) == 0

    out, err = capsys.readouterr()
    assert out == "HELLO\nAGAIN\n", "no command was sent as a message"
    sent = [body for _, path, body in portal.calls if path == "/v1/chat/completions"]
    assert [(body["temperature"], body["max_tokens"]) for body in sent] == [(0.0, sent[0]["max_tokens"]), (0.7, 5)]
    assert "top_k" not in sent[1], "a value out of its bounds is not set"
    assert sent[1]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "again"},
    ], "a new system message starts the conversation again"
    assert "/set top_k: not a whole number: '1.5'" in err
    assert "system message: 'Be brief.'; max_tokens=5, temperature=0.7" in err
    assert "no command /frobnicate: /set system TEXT" in err


def test_set_format_json_holds_the_next_answers_to_json_until_set_format_text(portal, capsys, monkeypatch):
    stdin(monkeypatch, "one\n/set format json\n/show\ntwo\n/set format text\nthree\n/set format yaml\n")

    assert app.main(["chat", "tiny"], env=portal.env) == 0

    sent = [body for _, path, body in portal.calls if path == "/v1/chat/completions"]
    assert [body.get("response_format") for body in sent] == [None, {"type": "json_object"}, None]
    err = capsys.readouterr().err
    assert "format=json" in err and "/set format: json or text, not 'yaml'" in err


def test_a_message_of_several_lines_goes_between_triple_quotes(portal, capsys, monkeypatch):
    stdin(monkeypatch, '"""first line\n\nsecond line\n"""\n"""one line"""\n')

    assert app.main(["chat", "tiny"], env=portal.env) == 0

    # The stand-in answers each message in capitals: each went whole, the quotes left out.
    assert capsys.readouterr().out == "FIRST LINE\n\nSECOND LINE\nONE LINE\n"


def test_a_refused_turn_leaves_an_interactive_chat_going_with_its_conversation_less_that_turn(
    portal, capsys, monkeypatch
):
    stdin(monkeypatch, "hello\ntoo long\nagain\n", terminal=True)

    assert app.main(["chat", "tiny"], env=portal.env) == 0

    out, err = capsys.readouterr()
    assert "HELLO\n" in out and "AGAIN\n" in out
    assert "error: input too long for this replica's KV cache" in err and "/clear forgets the conversation" in err
    sent = [body["messages"] for method, path, body in portal.calls if path == "/v1/chat/completions"]
    assert sent[-1] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "HELLO"},
        {"role": "user", "content": "again"},
    ], "the refused turn is not sent again"


def interrupted_at(monkeypatch, piece: str) -> None:
    """Ctrl-C as the answer's `piece` arrives (the chat's stand-in answers in capitals, two
    letters first): what a user who stops an answer does."""
    writer = talk._writer

    def writer_of(console: Any) -> Any:
        write = writer(console)

        def interrupting(text: str) -> None:
            if text == piece:
                raise KeyboardInterrupt
            write(text)

        return interrupting

    monkeypatch.setattr(talk, "_writer", writer_of)


def test_ctrl_c_stops_a_chats_answer_and_the_chat_goes_on_without_that_turn(portal, capsys, monkeypatch):
    stdin(monkeypatch, "hello\nstop me\nagain\n", terminal=True)
    interrupted_at(monkeypatch, "ST")

    assert app.main(["chat", "tiny"], env=portal.env) == 0

    out, err = capsys.readouterr()
    assert "HELLO\n" in out and "AGAIN\n" in out and "OP ME" not in out
    assert "(stopped: that turn is left out of the conversation)" in err
    sent = [body["messages"] for method, path, body in portal.calls if path == "/v1/chat/completions"]
    assert sent[-1] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "HELLO"},
        {"role": "user", "content": "again"},
    ], "the stopped turn is not sent again"


def test_ctrl_c_stops_runs_answer_with_the_shells_exit_status_for_it(portal, capsys, monkeypatch):
    portal.deployed["tiny"] = {}
    interrupted_at(monkeypatch, " upon")

    assert app.main(["run", "tiny", "Tell me a story"], env=portal.env) == 130

    out, err = capsys.readouterr()
    assert out == "Once\n" and "interrupted: the answer was stopped" in err


def test_a_conversation_grown_past_the_kv_cache_loses_its_oldest_turns_but_not_its_system_message(
    portal, capsys, monkeypatch
):
    stdin(monkeypatch, "aaaaaaaaaa\nbbbbbbbbbb\ncccccccccc\ndddddddddd\n")

    assert app.main(["chat", "tiny", "--system", "be"], env=portal.env) == 0

    out, err = capsys.readouterr()
    assert out == "AAAAAAAAAA\nBBBBBBBBBB\nCCCCCCCCCC\nDDDDDDDDDD\n"
    assert err.count("the oldest turn is left out") == 2, err
    sent = [body["messages"] for _, path, body in portal.calls if path == "/v1/chat/completions"]
    assert sent[-1] == [
        {"role": "system", "content": "be"},
        {"role": "user", "content": "cccccccccc"},
        {"role": "assistant", "content": "CCCCCCCCCC"},
        {"role": "user", "content": "dddddddddd"},
    ]


def test_a_single_turn_past_the_kv_cache_is_refused_with_nothing_left_to_leave_out(portal, capsys, monkeypatch):
    stdin(monkeypatch, "x" * 50 + "\n")

    assert app.main(["chat", "tiny"], env=portal.env) == 1

    assert "error: input too long for this replica's KV cache" in capsys.readouterr().err
    assert len([path for _, path, _ in portal.calls if path == "/v1/chat/completions"]) == 1


def test_a_refused_turn_ends_a_chat_read_from_a_pipe_with_exit_1(portal, capsys, monkeypatch):
    stdin(monkeypatch, "too long\nnot sent\n")

    assert app.main(["chat", "tiny"], env=portal.env) == 1

    assert "input too long" in capsys.readouterr().err
    assert len([path for _, path, _ in portal.calls if path == "/v1/chat/completions"]) == 1


@pytest.mark.parametrize(
    ("deployment", "asked"),
    [
        # Its replicas' KV caches, the smallest: half of 16 blocks of 16 tokens.
        (
            {"replicas": [{"state": "serving", "kv": {"block_tokens": 16, "blocks_total": 16}},
                          {"state": "serving", "kv": {"block_tokens": 16, "blocks_total": 64}},
                          {"state": "stopped", "kv": {"block_tokens": 16, "blocks_total": 1}}],
             "memory": {"max_tokens": 1024}},
            128,
        ),
        # None awake: what its replicas are sized for.
        ({"replicas": [{"state": "sleeping", "kv": None}], "memory": {"max_tokens": 300}}, 150),
        # Room for a whole answer: the default.
        ({"replicas": [], "memory": {"max_tokens": 4096}}, 256),
    ],
)  # fmt: skip
def test_run_asks_for_no_more_than_half_the_kv_cache_when_not_told_how_much(portal, capsys, deployment, asked):
    portal.deployed["small"] = deployment

    assert app.main(["run", "small", "Hi"], env=portal.env) == 0
    assert app.main(["run", "small", "Hi", "--max-tokens", "1000"], env=portal.env) == 0

    sent = [body["max_tokens"] for _, path, body in portal.calls if path == "/v1/completions"]
    assert sent == [asked, 1000], "what it is told, it asks for"


def test_embed_prints_one_json_vector_a_line_in_the_inputs_order(portal, capsys, monkeypatch):
    assert app.main(["embed", "enc", "a", "abc"], env=portal.env) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [[1.0, 0.5], [3.0, 0.5]]

    stdin(monkeypatch, "one\n\ntwo words\n")
    assert app.main(["embed", "enc"], env=portal.env) == 0
    assert portal.calls[-1][2]["input"] == ["one", "two words"]


def test_rerank_prints_the_documents_the_most_relevant_first_each_after_its_score(portal, capsys, monkeypatch):
    assert app.main(["rerank", "enc", "cats?", "a cat", "the cats nap", "x"], env=portal.env) == 0
    assert capsys.readouterr().out == "1.2000\tthe cats nap\n0.5000\ta cat\n0.1000\tx\n"

    stdin(monkeypatch, "one\n\ntwo words\n")
    assert app.main(["rerank", "enc", "q", "--top", "1"], env=portal.env) == 0
    assert capsys.readouterr().out == "0.9000\ttwo words\n"
    assert portal.calls[-1][2] == {
        "model": "enc", "query": "q", "documents": ["one", "two words"], "timeout": 300.0, "top_n": 1,
        "return_documents": False,
    }  # fmt: skip


def test_ps_counts_a_failover_pairs_memory_once_on_the_member_that_holds_it():
    from rich.console import Console

    from gpuportal.cli.talk import ps_table

    pair = {"deployment": "duo", "node": "box", "gpus": [0], "gpu_mem_bytes_by_id": {"0": 1400 * 1024**2}}
    member = {"pair": 2, "lease_epoch": 2}
    replicas = [
        {**pair, "id": "a" * 32, "state": "serving", "failover_state": {**member, "state": "active", "holder": True}},
        {**pair, "id": "b" * 32, "state": "standby", "gpus": [], "failover_state": {**member, "holder": False}},
        # The active it took over from: failed, it holds nothing.
        {**pair, "id": "9" * 32, "state": "failed", "gpus": [], "failover_state": {**member, "holder": False}},
        {**SERVING, "gpu_mem_bytes_by_id": {"0": 2 * 1024**3}, "failover_state": None},
    ]
    replicas = [shaped("Replica", r) for r in replicas]
    console = Console(file=io.StringIO(), width=200)
    console.print(ps_table(replicas))

    rows = [line.split()[:6] for line in console.file.getvalue().splitlines()[1:]]
    assert rows == [
        ["duo", "99999999", "failed", "box", "-", "-"],
        ["duo", "aaaaaaaa", "serving", "box/0", "1.4", "GiB"],
        ["duo", "bbbbbbbb", "standby", "box/0", "in", "aaaaaaaa's"],  # beside it, on the GPU it would take
        ["tiny", "bbbbbbbb", "serving", "box/0", "2.0", "GiB"],
    ]


def test_ps_shows_the_kv_blocks_held_those_cached_and_the_prefix_caches_hits():
    from rich.console import Console

    from gpuportal.cli.talk import ps_table

    kv = {"block_tokens": 16, "blocks_total": 128, "blocks_used": 3, "blocks_cached": 24}
    figures = [
        {**kv, "prefix_queried": 4000, "prefix_hits": 3000},
        {**kv, "blocks_cached": 0, "prefix_queried": 0, "prefix_hits": 0},
        None,
    ]
    replicas = [shaped("Replica", {**SERVING, "id": str(i) * 32, "kv": f}) for i, f in enumerate(figures)]
    console = Console(file=io.StringIO(), width=200)
    console.print(ps_table(replicas))

    header, *lines = console.file.getvalue().splitlines()
    kvs = [line[header.index("KV BLOCKS") :].strip() for line in lines]
    assert kvs == ["3/128 +24 cached, 75% hit", "3/128", "-"]


def test_ps_says_how_long_since_each_replica_was_used_not_when():
    from datetime import UTC, datetime, timedelta

    from rich.console import Console

    from gpuportal.cli.talk import ps_table

    now = datetime.now(UTC)
    used = {
        "a" * 32: (now - timedelta(minutes=12, seconds=5)).isoformat(),
        "b" * 32: (now - timedelta(hours=3)).isoformat(),
        # The portal's clock a little ahead of this one's: just used, not a negative age.
        "c" * 32: (now + timedelta(seconds=2)).isoformat(),
        "d" * 32: None,
    }
    replicas = [shaped("Replica", {**SERVING, "id": rid, "last_accessed": at}) for rid, at in used.items()]
    console = Console(file=io.StringIO(), width=200)
    console.print(ps_table(replicas))

    ages = [" ".join(line.split()[5:-1]) for line in console.file.getvalue().splitlines()[1:]]  # KV last
    assert ages == ["12 min ago", "3 h ago", "0 s ago", "-"]


def test_ps_shows_what_is_loaded_where_awake_or_asleep_and_not_what_stopped(portal, capsys):
    assert app.main(["ps"], env=portal.env) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["MODEL", "REPLICA", "STATE", "ON", "GPU", "MEMORY", "LAST", "USED", "KV", "BLOCKS"]
    assert lines[1].split() == ["big", "cccccccc", "sleeping", "box/0", "-", "-", "-"]
    assert lines[2].split() == ["tiny", "bbbbbbbb", "serving", "box/0", "2.0", "GiB", "-", "-"]
    assert len(lines) == 3, "the stopped replica is history"
    assert app.main(["ps", "big"], env=portal.env) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
