"""Request overhead: what the portal adds to a request, against calling the same model directly.

One run, side by side: a tiny causal LM called in this process (the baseline), then the same
model behind the portal over HTTP (gunicorn, a real node agent, a real replica process on a
virtual GPU): `POST /api/deployments/{name}/infer/` and `POST /v1/chat/completions`, one token
per request. Added latency = portal − direct, at p50 and p99. Then the wake latency of a sleeping
replica: the time to the first answer of a request sent while it sleeps.

    python -m bench.request_overhead [--requests 300] [--wakes 5] [--no-record]

Uses DATABASE_URL / REDIS_URL when set, else embedded servers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import setup_database, stop
from bench.portal import Http, Portal, percentile, start_redis_if_needed, wait

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


def direct_baseline(model_dir: Path, count: int) -> list[float]:
    """The model called in this process exactly as a replica calls it: the same executor, and the
    same paged engine on a KV pool sized for the same cap, so the difference is the portal's."""
    from inference.batching import Batcher, eos_ids, run_until_idle
    from inference.loaders import load_model, tensor_bytes
    from inference.paged import engine_for
    from inference.replica import load_tokenizer
    from inference.requestqueue import Request
    from inference.serving import Executor

    model = load_model(str(model_dir), "transformers", "float32")
    tokenizer = load_tokenizer(str(model_dir), "transformers")
    executor = Executor(model, tokenizer)
    engine = engine_for(
        model, weights_bytes=tensor_bytes(model), cap_bytes=CAP_BYTES, max_tokens=MAX_TOKENS, context_bytes=0
    )
    batcher = Batcher(engine, tokenizer, eos_ids(model))
    request = Request(id="x", deployment="tiny", kind="generate", input="Hello", params={"max_tokens": 1})

    def call() -> None:
        batcher.submit(executor.sequence(request, None))
        run_until_idle(batcher)

    timed(call, 20)  # warm-up
    return timed(call, count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--wakes", type=int, default=5)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gpuportal-bench-overhead-"))
    redis_server = start_redis_if_needed(tmp)
    db_server = setup_database("gpuportal_bench_overhead")
    portal: Portal | None = None
    try:
        from django.contrib.auth.models import User
        from rest_framework.authtoken.models import Token

        from bench.report import record, table
        from inference.management.commands.make_tiny_model import write_tiny_model
        from scheduling.models import Replica
        from scheduling.services import deployments, sleep
        from scheduling.services.deployments import DeploymentSpec

        model_dir = write_tiny_model(tmp / "tiny", size_mb=2, seed=5, log=lambda _: None).path
        print("direct calls…", flush=True)
        direct = direct_baseline(model_dir, args.requests)

        portal = Portal(tmp)
        key = Token.objects.create(user=User.objects.create_user("bench", is_staff=True)).key
        portal.ready(key)
        deployments.create(
            DeploymentSpec(name="tiny", source=str(model_dir), override_bytes=CAP_BYTES, max_tokens=MAX_TOKENS)
        )
        wait(lambda: Replica.objects.filter(deployment__name="tiny", state="serving").exists(), 240, "the replica")
        http = Http(portal.port, key)

        def infer() -> None:
            status, body = http.post("/api/deployments/tiny/infer/", {"input": "Hello", "params": {"max_tokens": 1}})
            assert status == 200 and body["status"] == "done", body

        def chat() -> None:
            status, body = http.post(
                "/v1/chat/completions",
                {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1},
            )
            assert status == 200, body

        print("through /infer/ and /v1…", flush=True)
        timed(infer, 20)
        portal_infer = timed(infer, args.requests)
        timed(chat, 20)
        portal_chat = timed(chat, args.requests)

        wakes = []
        replica_id = Replica.objects.get(deployment__name="tiny").id
        for _ in range(args.wakes):
            sleep.sleep_replica(replica_id, reason="benchmark: measure the wake")
            while Replica.objects.get(pk=replica_id).state != "sleeping":
                time.sleep(0.05)
            began = time.perf_counter()
            infer()
            wakes.append(time.perf_counter() - began)
        http.close()

        ms = 1000
        p50, p99 = statistics.median(direct), percentile(direct, 0.99)
        rows = [
            ["direct (in process)", f"{ms * p50:.2f}", f"{ms * p99:.2f}", "-", "-", f"{len(direct) / sum(direct):.0f}"]
        ]
        for name, samples in (("POST /api/…/infer/", portal_infer), ("POST /v1/chat/completions", portal_chat)):
            rows.append(
                [
                    name,
                    f"{ms * statistics.median(samples):.2f}",
                    f"{ms * percentile(samples, 0.99):.2f}",
                    f"{ms * (statistics.median(samples) - statistics.median(direct)):.2f}",
                    f"{ms * (percentile(samples, 0.99) - percentile(direct, 0.99)):.2f}",
                    f"{len(samples) / sum(samples):.0f}",
                ]
            )
        headers = ["path", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "requests/s (one client)"]
        report = table(headers, rows)
        wake = table(
            ["wake of a sleeping replica (virtual GPU)", "p50 ms", "max ms", "trials"],
            [
                [
                    "request sent to a sleeping deployment, until its answer",
                    f"{ms * statistics.median(wakes):.0f}",
                    f"{ms * max(wakes):.0f}",
                    len(wakes),
                ]
            ],
        )
        print("\n" + report + "\n\n" + wake)
        if not args.no_record:
            record(
                "request_overhead",
                "Request overhead: the portal against a direct call",
                f"`python -m bench.request_overhead --requests {args.requests}`: a tiny causal LM (2 MB), one "
                "generated token per request, one client; direct = the replica's executor and paged KV engine "
                "called in the benchmark's process; portal = over HTTP to gunicorn (1 worker, 4 threads), queued "
                "in Redis, served by a real replica process on a virtual GPU. Added = portal − direct.\n\n"
                + report
                + "\n\n"
                + wake,
            )
    finally:
        if portal is not None:
            portal.stop()
        stop(db_server)
        if redis_server is not None:
            redis_server.stop()


if __name__ == "__main__":
    main()
