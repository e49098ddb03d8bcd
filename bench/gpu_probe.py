"""The probe part of bench.gpu: one replica, in this process, on one GPU, through the project's own
ReplicaHost and CudaBackend (what `python -m inference.replica --backend cuda` runs), measured from
inside so that the cap and the generated tokens can be checked too.

    python -m bench.gpu_probe --model-dir DIR --dtype float32 [--max-tokens 512] [--gpu 0]

Its own process on purpose: NVML's per-process figure is then the replica's alone, and the
allocator cap it sets cannot leak into anything else. It prints `PROBE {json}` lines on stdout,
one per step (setup, bandwidth, load, generate, prefill, cap, cycle ×2, generate_after_wake, or
error with the step it stopped at); logs go to stderr. bench.gpu turns them into table rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

MiB = 1024**2
GiB = 1024**3
# The generation compared with transformers, as in the findings: greedy, 32 new tokens.
COMPARE_TOKENS = 32
PROMPT = "Hello, world! What is the capital of France?"
# The prefill check leaves this many tokens of the pool for the generated ones.
PREFILL_NEW_TOKENS = 16
# Between the cap and these allocations: above, allocator rounding (2 MiB segments) cannot hide
# an over-allocation; below, it cannot push a legal one over.
CAP_MARGIN_BYTES = 32 * MiB
# The host-to-device reference copies the weights' size, within these bounds (a pageable copy of
# many GB would take seconds and tells nothing more).
COPY_MIN_BYTES, COPY_MAX_BYTES = 64 * MiB, 2 * GiB
COPY_TRIALS = 3


def out(tag: str, **fields: Any) -> None:
    print("PROBE " + json.dumps({"tag": tag, **fields}, default=str), flush=True)


class EventSink:
    """A stream for the replica's EventWriter: keeps its events instead of writing them to stdout."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def write(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                self.events.append(json.loads(line))

    def flush(self) -> None:
        pass

    def last(self, since: int, *names: str) -> dict[str, Any] | None:
        for event in reversed(self.events[since:]):
            if event.get("event") in names:
                return event
        return None


def nvml_bytes(gpu: int) -> int | None:
    from inference.backends import nvml_process_bytes

    return (nvml_process_bytes(os.getpid()) or {}).get(str(gpu))


def rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def host_to_device(nbytes: int, gpu: int) -> dict[str, Any]:
    """Best of COPY_TRIALS copies of nbytes from pinned and from pageable host memory: the ceiling
    a wake's copy of the weights is compared with, on this machine, in this process."""
    import torch

    from bench.gpu import gbps

    result: dict[str, Any] = {"nbytes": nbytes}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        best = None
        for trial in range(COPY_TRIALS + 1):  # the first one warms up (allocator, DMA mappings)
            torch.cuda.synchronize(gpu)
            began = time.perf_counter()
            device = host.to(f"cuda:{gpu}", non_blocking=True)
            torch.cuda.synchronize(gpu)
            seconds = time.perf_counter() - began
            del device
            if trial:
                best = seconds if best is None else min(best, seconds)
        result["pinned_gbps" if pinned else "pageable_gbps"] = gbps(nbytes, best)
        del host
        torch.cuda.empty_cache()
    return result


def make_host(**kwargs: Any) -> Any:
    """The replica host the product runs, in this process, on the probe's GPU."""
    from inference.host import ReplicaHost

    return ReplicaHost(**kwargs)


def paged_tokens(host: Any, prompt: list[int], max_tokens: int) -> list[int]:
    from inference.batching import Batcher, Sequence, eos_ids, run_until_idle

    if host.paged is None:
        raise RuntimeError("the replica has no KV block pool")
    batcher = Batcher(host.paged, host.tokenizer, eos_ids(host.model))
    seq = Sequence(prompt=list(prompt), max_tokens=max_tokens)
    batcher.submit(seq)
    run_until_idle(batcher)
    if seq.error is not None:
        raise RuntimeError(f"paged generation failed: {seq.error!r}")
    return list(seq.generated)


def reference_tokens(host: Any, prompt: list[int], max_tokens: int, gpu: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt], device=f"cuda:{gpu}")
    with torch.no_grad():
        output = host.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
    return output[0, len(prompt) :].tolist()


def prefill(host: Any, max_tokens: int, gpu: int) -> dict[str, Any]:
    """A prompt that fills max_tokens: activations at their largest, inside the cap or not."""
    import torch

    from inference.batching import Batcher, Sequence, eos_ids, run_until_idle

    pool = host.paged.pool
    capacity = pool.blocks_total * pool.block_tokens
    length = max(1, min(max_tokens, capacity) - PREFILL_NEW_TOKENS)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, len(host.tokenizer), (length,), generator=generator).tolist()
    torch.cuda.reset_peak_memory_stats(gpu)
    batcher = Batcher(host.paged, host.tokenizer, eos_ids(host.model))
    seq = Sequence(prompt=prompt, max_tokens=PREFILL_NEW_TOKENS)
    batcher.submit(seq)
    run_until_idle(batcher)
    torch.cuda.synchronize(gpu)
    return {
        "prompt_tokens": length,
        "generated": len(seq.generated),
        "error": repr(seq.error) if seq.error is not None else None,
        "nvml_bytes": nvml_bytes(gpu),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(gpu),
    }


def cap_check(host: Any, fraction: float, gpu: int) -> dict[str, Any]:
    """Allocate past the allocator's cap (must raise out-of-memory) and just under it (must work)."""
    import torch

    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(gpu)[1]
    limit = int(fraction * total)
    room = limit - torch.cuda.memory_reserved(gpu)
    result: dict[str, Any] = {
        "fraction": round(fraction, 6),
        "limit_bytes": limit,
        "room_bytes": room,
        "margin_bytes": CAP_MARGIN_BYTES,
    }
    try:
        over = torch.empty(max(room, 0) + CAP_MARGIN_BYTES, dtype=torch.uint8, device=f"cuda:{gpu}")
    except torch.cuda.OutOfMemoryError:
        result["over"] = "oom"
    else:
        result["over"] = "allocated"
        del over
    torch.cuda.empty_cache()
    if room <= CAP_MARGIN_BYTES:
        result["under"] = f"no room: {room} bytes left under the cap"
    else:
        try:
            under = torch.empty(room - CAP_MARGIN_BYTES, dtype=torch.uint8, device=f"cuda:{gpu}")
        except torch.cuda.OutOfMemoryError as exc:
            result["under"] = "oom: " + str(exc).splitlines()[0][:200]
        else:
            torch.cuda.synchronize(gpu)
            result["under"] = "ok"
            result["nvml_at_cap_bytes"] = nvml_bytes(gpu)
            del under
    torch.cuda.empty_cache()
    return result


def short(exc: BaseException) -> str:
    """One line for the table: the exception's type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


class Probe:
    """The probe's steps, in order, on one GPU; `step` names the one running, for the error record."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.gpu, self.step = args, args.gpu, "setup"

    def run(self) -> None:
        try:
            self.setup()
            self.load()
            self.generation()
            self.cycles()
        except Exception as exc:
            out("error", step=self.step, error=short(exc), traceback=traceback.format_exc()[-3000:])
            raise

    def setup(self) -> None:
        import torch

        from gpuportal.wire import memory
        from inference.model_size import shape_from_model_dir
        from scheduling.core.placement import gpu_fraction

        args, gpu = self.args, self.gpu
        torch.cuda.set_device(gpu)
        torch.zeros(1, device=f"cuda:{gpu}")
        torch.cuda.synchronize(gpu)
        measured = nvml_bytes(gpu)
        bare = measured - torch.cuda.memory_reserved(gpu) if measured is not None else None
        self.context = args.context_bytes if args.context_bytes is not None else memory.TYPICAL_CUDA_CONTEXT_BYTES
        self.shape = shape_from_model_dir(args.model_dir, args.dtype)
        est = memory.estimate(self.shape, max_tokens=args.max_tokens, cuda_context_bytes=self.context)
        self.reservation = est.total_bytes
        cuda_total = torch.cuda.mem_get_info(gpu)[1]
        self.fraction = gpu_fraction(self.reservation, cuda_total)
        parts = ("weights_bytes", "kv_bytes", "activation_bytes", "context_bytes", "overhead_bytes")
        out(
            "setup",
            device=torch.cuda.get_device_name(gpu),
            cuda_total_bytes=cuda_total,
            reservation_bytes=self.reservation,
            estimate={p: getattr(est, p, 0) for p in parts},
            context_assumed_bytes=self.context,
            context_bare_bytes=bare,
            fraction_asked=self.fraction,
        )
        self.step = "bandwidth"
        out("bandwidth", **host_to_device(min(max(self.shape.weight_bytes, COPY_MIN_BYTES), COPY_MAX_BYTES), gpu))

    def load(self) -> None:
        import torch

        from inference.backends import CudaBackend, Placement
        from inference.event_stream import EventWriter

        self.step = "load"
        gpu = self.gpu
        self.sink = EventSink()
        placement = Placement.parse([gpu], {str(gpu): self.reservation}, self.fraction)
        self.host = make_host(
            replica_id="bench-gpu-probe",
            source=str(self.args.model_dir),
            loader="transformers",
            dtype=self.args.dtype,
            placement=placement,
            backend=CudaBackend(),
            events=EventWriter(self.sink),  # type: ignore[arg-type]  # duck-typed: write and flush
            kv_max_tokens=self.args.max_tokens,
            context_bytes=self.context,
        )
        began = time.perf_counter()
        self.host.load()
        torch.cuda.synchronize(gpu)
        seconds = time.perf_counter() - began
        serving = self.sink.last(0, "serving", "failed")
        if serving is None or serving.get("event") != "serving":
            raise RuntimeError(f"the replica did not serve: {serving}")
        self.serving = serving
        # The fraction the backend really applied (it may take the context out of the cap first).
        self.applied = getattr(self.host.backend, "fraction", None) or self.host.placement.fraction or self.fraction
        out(
            "load",
            seconds=seconds,
            weights_bytes=self.host.weights_bytes,
            nvml_bytes=nvml_bytes(gpu),
            allocator_reserved_bytes=torch.cuda.memory_reserved(gpu),
            fraction_applied=self.applied,
            event=serving,
        )

    def generation(self) -> None:
        import torch

        host, gpu = self.host, self.gpu
        self.step = "generate"
        self.prompt = host.tokenizer(PROMPT)["input_ids"]
        self.paged: list[int] | None = None
        try:
            self.paged = paged_tokens(host, self.prompt, COMPARE_TOKENS)
            out("generate", paged=self.paged, reference=reference_tokens(host, self.prompt, COMPARE_TOKENS, gpu))
        except Exception as exc:  # a finding, not the end of the probe: the memory figures still count
            out("generate", error=short(exc))
        self.step = "prefill"
        try:
            out("prefill", **prefill(host, self.args.max_tokens, gpu))
        except Exception as exc:  # an out-of-memory here says the activation reserve is too small
            out("prefill", error=short(exc), nvml_bytes=nvml_bytes(gpu))
            torch.cuda.empty_cache()
        self.step = "cap"
        out("cap", **cap_check(host, self.applied, gpu))

    def wake_reservation(self, sleeping: dict[str, Any] | None) -> int:
        """What the control plane would reserve for the wake (scheduling.services.deployments.
        need_bytes): the need the load measured, plus what the context has grown since it was
        counted, as the sleep's residual shows it (gpuportal.wire.memory.with_grown_context)."""
        from gpuportal.wire import memory

        need = self.serving.get("need_bytes") or self.reservation
        counted = self.serving.get("context_bytes")
        residual = max((int(v or 0) for v in ((sleeping or {}).get("residual_bytes_by_id") or {}).values()), default=0)
        return memory.with_grown_context(int(need), counted if isinstance(counted, int) else None, residual)

    def cycles(self) -> None:
        import torch

        from scheduling.core.placement import gpu_fraction

        host, gpu, sink = self.host, self.gpu, self.sink
        for n in (1, 2):  # each sleep packs a fresh pinned arena (every wake frees it): the two should agree
            self.step = f"sleep {n}"
            since = len(sink.events)
            torch.cuda.synchronize(gpu)
            began = time.perf_counter()
            host.sleep(0.0)
            sleep_s = time.perf_counter() - began
            sleeping = sink.last(since, "sleeping")
            after_sleep = nvml_bytes(gpu)
            # What the allocator still holds: the weights' part of NVML's figure, apart from the
            # context, which grows meanwhile as the process loads kernels.
            allocator_after_sleep = torch.cuda.memory_reserved(gpu)
            self.step = f"wake {n}"
            reservation = self.wake_reservation(sleeping)
            since = len(sink.events)
            began = time.perf_counter()
            host.wake([gpu], {str(gpu): reservation}, gpu_fraction(reservation, torch.cuda.mem_get_info(gpu)[1]))
            torch.cuda.synchronize(gpu)
            wake_s = time.perf_counter() - began
            out(
                "cycle",
                n=n,
                sleep_s=sleep_s,
                wake_s=wake_s,
                nvml_after_sleep_bytes=after_sleep,
                allocator_after_sleep_bytes=allocator_after_sleep,
                reserved_bytes=reservation,
                nvml_after_wake_bytes=nvml_bytes(gpu),
                rss_bytes=rss_bytes(),
                sleeping_event=sleeping,
                event=sink.last(since, "woken", "failed"),
            )
        self.step = "generate_after_wake"
        try:
            out("generate_after_wake", paged=paged_tokens(host, self.prompt, COMPARE_TOKENS), reference=self.paged)
        except Exception as exc:
            out("generate_after_wake", error=short(exc))
        host.stop(0.0)


def run(args: argparse.Namespace) -> None:
    Probe(args).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument(
        "--context-bytes",
        type=int,
        default=None,
        help="CUDA context the reservation counts (default: gpuportal.wire.memory's).",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # As the replica program does: never the hub, and torch's GPU indices in NVML's order.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    try:
        run(args)
    except Exception:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
