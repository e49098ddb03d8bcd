"""Request overhead: what the portal adds to a request, against calling the same model directly.

One run, side by side: a tiny causal LM called in this process (the baseline, from text and from
chat messages), and the same model behind the portal over HTTP (granian, a real node agent, a
real replica process on a virtual GPU): `POST /api/deployments/{name}/infer/` and
`POST /v1/chat/completions`, one token per request, the four alternating in rounds. Added
latency = portal − direct of the same input, at p50 and p99. Then the wake latency of a sleeping
replica: the time to the first answer of a request sent while it sleeps.

    python -m bench.request_overhead [--requests 300] [--wakes 5] [--no-record]

Uses DATABASE_URL / REDIS_URL when set, else embedded servers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.portal import Http, Portal, percentile, servers, staff_key, wait
from gpuportal.wire.states import ReplicaState as S

ROOT = Path(__file__).resolve().parent.parent
# The replica's reservation and the deployment's max_tokens, for the portal and the direct call alike.
CAP_BYTES = 512 * 1024**2
MAX_TOKENS = 256


def timed(call, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        call()
        samples.append(time.perf_counter() - began)
    return samples


MESSAGES = [{"role": "user", "content": "Hello"}]
# Calls alternate in rounds, so that whatever else the machine does in the meantime weighs on the
# direct calls and the portal's alike.
ROUNDS = 10


def direct_calls(model_dir: Path) -> tuple[Callable[[], None], Callable[[], None]]:
    """The model called in this process exactly as a replica calls it: the same executor, the same
    paged engine on a KV pool sized for the same cap, the same torch threads; one call generates
    from text, the other from chat messages (the chat template makes its prompt longer), so the
    difference from each portal path is the portal's."""
    import torch

    from gpuportal.wire.requestqueue import Request
    from inference.batching import Batcher, eos_ids, run_until_idle
    from inference.host import load_tokenizer
    from inference.loaders import load_model, tensor_bytes
    from inference.paged import engine_for
    from inference.serving import Executor

    # As inference.replica sets it for a replica on a virtual GPU.
    torch.set_num_threads(int(os.environ.get("GPUPORTAL_VIRTUAL_CPU_THREADS", "1")))
    model = load_model(str(model_dir), "transformers", "float32")
    tokenizer = load_tokenizer(str(model_dir), "transformers")
    executor = Executor(model, tokenizer)
    engine = engine_for(
        model, weights_bytes=tensor_bytes(model), cap_bytes=CAP_BYTES, max_tokens=MAX_TOKENS, context_bytes=0
    )
    batcher = Batcher(engine, tokenizer, eos_ids(model))

    def caller(kind: str, data: object) -> Callable[[], None]:
        request = Request(id="x", deployment="tiny", kind=kind, input=data, params={"max_tokens": 1})

        def call() -> None:
            batcher.submit(executor.sequence(request, None))
            run_until_idle(batcher)

        return call

    return caller("generate", "Hello"), caller("chat", MESSAGES)


def interleaved(calls: dict[str, Callable[[], None]], count: int) -> dict[str, list[float]]:
    """`count` timed calls of each, in ROUNDS alternating rounds, after a warm-up of each."""
    for call in calls.values():
        timed(call, 20)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    per_round = max(1, count // ROUNDS)
    for _ in range(ROUNDS):
        for name, call in calls.items():
            samples[name] += timed(call, per_round)
    return samples


MS = 1000


def portal_calls(http: Http) -> tuple[Callable[[], None], Callable[[], None]]:
    """One-token calls of the portal's two paths: `/infer/` from text, `/v1` from chat messages."""

    def infer() -> None:
        status, body = http.post("/api/deployments/tiny/infer/", {"input": "Hello", "params": {"max_tokens": 1}})
        assert status == 200 and body["status"] == "done", body

    def chat() -> None:
        status, body = http.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 1})
        assert status == 200, body

    return infer, chat


def wake_times(infer: Callable[[], None], count: int) -> list[float]:
    """Seconds from a request sent while the deployment's replica sleeps to its answer."""
    from scheduling.models import Replica
    from scheduling.services import sleep

    wakes = []
    replica_id = Replica.objects.get(deployment__name="tiny").id
    for _ in range(count):
        # The answer can come back before the agent's report marks the replica serving again.
        wait(lambda: Replica.objects.get(pk=replica_id).state == S.SERVING, 30, "the woken replica")
        sleep.sleep_replica(replica_id, reason="benchmark: measure the wake")
        while Replica.objects.get(pk=replica_id).state != S.SLEEPING:
            time.sleep(0.05)
        began = time.perf_counter()
        infer()
        wakes.append(time.perf_counter() - began)
    return wakes


def row(name: str, values: list[float], baseline: list[float] | None) -> list[object]:
    added = (
        ["-", "-"]
        if baseline is None
        else [
            f"{MS * (statistics.median(values) - statistics.median(baseline)):.2f}",
            f"{MS * (percentile(values, 0.99) - percentile(baseline, 0.99)):.2f}",
        ]
    )
    return [
        name,
        f"{MS * statistics.median(values):.2f}",
        f"{MS * percentile(values, 0.99):.2f}",
        *added,
        f"{len(values) / sum(values):.0f}",
    ]


def report(samples: dict[str, list[float]], wakes: list[float]) -> tuple[str, str]:
    """(the overhead table, the wake table)."""
    from bench.report import table

    rows = [
        row("direct, text (in process)", samples["direct text"], None),
        row("POST /api/…/infer/ (text)", samples["infer"], samples["direct text"]),
        row("direct, chat messages (in process)", samples["direct chat"], None),
        row("POST /v1/chat/completions", samples["chat"], samples["direct chat"]),
    ]
    headers = ["path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "requests/s (one client)"]
    wake = table(
        ["wake of a sleeping replica (virtual GPU)", "p50 ms", "max ms", "trials"],
        [
            [
                "request sent to a sleeping deployment, until its answer",
                f"{MS * statistics.median(wakes):.0f}",
                f"{MS * max(wakes):.0f}",
                len(wakes),
            ]
        ],
    )
    return table(headers, rows), wake


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--wakes", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    with servers("gpuportal-bench-overhead-", "gpuportal_bench_overhead") as tmp:
        from bench.report import record
        from inference.management.commands.make_tiny_model import write_tiny_model
        from scheduling.models import Replica
        from scheduling.services import deployments
        from scheduling.services.deployments import DeploymentSpec

        model_dir = write_tiny_model(tmp / "tiny", size_mb=2, seed=5, log=lambda _: None).path
        direct_generate, direct_chat = direct_calls(model_dir)

        with Portal(tmp) as portal:
            key = staff_key()
            portal.ready(key)
            deployments.create(
                DeploymentSpec(name="tiny", source=str(model_dir), override_bytes=CAP_BYTES, max_tokens=MAX_TOKENS)
            )
            wait(lambda: Replica.objects.filter(deployment__name="tiny", state=S.SERVING).exists(), 240, "the replica")
            http = Http(portal.port, key)
            infer, chat = portal_calls(http)
            print("direct calls, /infer/ and /v1, in alternating rounds…", flush=True)
            samples = interleaved(
                {"direct text": direct_generate, "infer": infer, "direct chat": direct_chat, "chat": chat},
                args.requests,
            )
            wakes = wake_times(infer, args.wakes)
            http.close()
            overhead, wake = report(samples, wakes)
            print("\n" + overhead + "\n\n" + wake)
            if not args.no_record:
                record(
                    "request_overhead",
                    "Request overhead: the portal against a direct call",
                    f"`python -m bench.request_overhead --requests {args.requests}`: a tiny causal LM (2 MB), one "
                    "generated token per request, one client; direct = the replica's executor and paged KV engine "
                    "called in the benchmark's process (one torch thread, as a replica on a virtual GPU), from text "
                    "and from chat messages; portal = over HTTP to granian (1 worker, 4 blocking threads), queued in "
                    "Redis, served by a real replica process on a virtual GPU. The four calls alternate in "
                    f"{ROUNDS} rounds. Added = portal − direct of the same input.\n\n" + overhead + "\n\n" + wake,
                )


if __name__ == "__main__":
    main()
