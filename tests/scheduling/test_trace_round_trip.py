"""`export_trace` → `plan` on a live stack with the tiny model: `up` on servers of its
own, the tiny causal LM served by a real replica under the real node agent, requests through the
REST API; then the two commands as an operator runs them beside the stack (they find its servers
in <data dir>/stack.env), and the trace holds exactly the requests that were answered."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
import time

import psycopg
import pytest
import redis

from gpuportal.stackenv import read_stack_env
from gpuportal.wire.requestqueue import RECORDS_KEY, records_key
from scheduling.simulation import planner
from scheduling.simulation.planner import DEFAULT_POLICIES
from tests.support.processes import wait_until
from tests.support.up import ROOT, Up, env_without_servers

pytestmark = pytest.mark.slow

MiB = 1024**2
GiB = 1024**3
LOAD_TIMEOUT = 180  # the replica process imports torch and transformers: seconds on 2 cores


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"manage.py {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def recorded_ids(urls: dict[str, str]) -> set[str]:
    """Ids of the ended requests the stack has recorded: still in Redis (the web's list, or a
    node's), or drained into PostgreSQL."""
    client = redis.Redis.from_url(urls["REDIS_URL"])
    try:
        lists = [RECORDS_KEY, *client.scan_iter(f"{records_key('*')}")]
        waiting = {json.loads(raw)["id"] for key in lists for raw in client.lrange(key, 0, -1)}
    finally:
        client.close()
    with psycopg.connect(urls["DATABASE_URL"], connect_timeout=10) as db:
        stored = {row[0] for row in db.execute("SELECT request_id FROM scheduling_requestrecord")}
    return waiting | stored


def fewest_gpus(plan: str) -> dict[str, int | str]:
    """Each policy's "fewest GPUs" in `manage.py plan`'s table."""
    found: dict[str, int | str] = {}
    for line in plan.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in DEFAULT_POLICIES:
            fewest = cells[1].removesuffix(" (bound)")
            found[cells[0]] = int(fewest) if fewest.isdigit() else fewest
    return found


def test_export_trace_then_plan_round_trips_requests_served_by_the_tiny_model(tmp_path, template_service):
    from inference.management.commands.make_tiny_model import write_tiny_model

    began = time.monotonic()
    model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=21, log=lambda _: None).path
    data_dir = tmp_path / "var"
    # The session's templates (tests/conftest.py): its agent forks replicas from an import made once.
    templates = {"GPUPORTAL_REPLICA_TEMPLATE_SOCKET": str(template_service.address)}
    up = Up(data_dir, "--virtual-gpus", "1x2GiB", "--node", "box", settings=templates)
    try:
        up.wait_up()
        token = up.token()
        body = {
            "name": "tiny",
            "model": {"source": str(model)},
            "replicas": 1,
            "memory": {"override_bytes": 200 * MiB, "max_tokens": 256},
        }
        # Answered at once, though the agent's first inspection takes seconds (it imports
        # transformers): a wait past the Redis client's socket timeout once answered 503 here.
        status, created = up.post("/api/deployments/", body, token)
        assert status == 201, created
        wait_until(lambda: up.serving(token, "tiny"), LOAD_TIMEOUT, "the tiny model to serve")

        # A few requests, through both ways in: the portal's own and the OpenAI-compatible one.
        answered: dict[str, tuple[int, int]] = {}  # request id → (prompt, output tokens)
        for n, prompt in enumerate(["Hello", "What is the capital of France?", "Once upon a time"]):
            infer = {"input": prompt, "params": {"max_tokens": 3 + n}, "timeout_s": 60}
            status, done = up.post("/api/deployments/tiny/infer/", infer, token)
            assert status == 200 and done["status"] == "done", done
            usage = done["output"]["usage"]
            answered[done["id"]] = (usage["prompt_tokens"], usage["completion_tokens"])
        completion_body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 5}
        status, completion = up.post("/v1/completions", completion_body, token)
        assert status == 200, completion
        usage = completion["usage"]
        answered[completion["id"].removeprefix("cmpl-")] = (usage["prompt_tokens"], usage["completion_tokens"])
        assert len(answered) == 4 and all(p > 0 and o > 0 for p, o in answered.values()), answered

        # Each ended request leaves a record in Redis, which the beat's drain (or the export's
        # own) moves into PostgreSQL: wait until all four are recorded, wherever they are now.
        urls = read_stack_env(data_dir / "stack.env")
        assert set(urls) >= {"DATABASE_URL", "REDIS_URL"}, urls
        wait_until(lambda: recorded_ids(urls) >= set(answered), 30, "the answered requests to be recorded")

        # The commands as a shell beside the stack runs them: no server URLs of their own.
        env = env_without_servers(GPUPORTAL_DATA_DIR=str(data_dir))
        catalogue = tmp_path / "catalogue.json"
        exported = manage(env, "export_trace", "--since", "1h", "--catalogue", str(catalogue))
        assert exported.stderr.startswith("4 requests since "), exported.stderr
        assert "left out" not in exported.stderr, exported.stderr
        assert exported.stdout.splitlines()[0] == "arrival,deployment,prompt_tokens,output_tokens"
        rows = list(csv.DictReader(io.StringIO(exported.stdout)))
        assert [r["deployment"] for r in rows] == ["tiny"] * 4, rows
        assert sorted((int(r["prompt_tokens"]), int(r["output_tokens"])) for r in rows) == sorted(answered.values())
        assert [r["arrival"] for r in rows] == sorted(r["arrival"] for r in rows)  # in order of arrival
        (entry,) = json.loads(catalogue.read_text())["deployments"]
        assert entry["name"] == "tiny" and entry["need_bytes"] > 0, entry
        trace = tmp_path / "trace.csv"
        trace.write_text(exported.stdout)

        # The plan on the portal's own catalogue and GPUs: the stack's one GPU serves it all.
        (gpu,) = up.get("/api/gpus/", token)[1]["results"]
        # The catalogue's need is what the replica's reservation holds, its CUDA context included.
        assert entry["need_bytes"] == gpu["reserved_bytes"] > 200 * MiB, (entry, gpu)
        text = manage(env, "plan", str(trace)).stdout
        assert text.startswith("4 requests to 1 deployment over "), text
        assert f"GPUs of {planner.gib(gpu['total_bytes'] / GiB)} GiB; 1 now;" in text, text
        assert fewest_gpus(text) == dict.fromkeys(DEFAULT_POLICIES, 1), text

        # On the exported catalogue, for GPUs too small to hold one replica: the plan names the
        # deployment that misses now and why, and the GPUs each policy needs for it.
        small = f"{entry['need_bytes'] / 1.9 / GiB:.4f}"
        text = manage(env, "plan", str(trace), "--catalogue", str(catalogue), "--gpu-memory-gib", small).stdout
        assert f"GPUs of {planner.gib(float(small))} GiB; 1 now;" in text, text
        assert fewest_gpus(text) == dict.fromkeys(DEFAULT_POLICIES, 2), text
        missed_now = text[text.index("Missed at 1 GPU (now):") : text.index("Missed at 2 GPUs")]
        assert re.search(r"^\| tiny +\| 4 +\| 4 +\| failed", missed_now, re.MULTILINE), text
    finally:
        assert up.stop() == 0
    print(f"round trip in {time.monotonic() - began:.1f} s")  # shown with -s; nothing asserts a time
