"""Sleep and wake bandwidth: the replica's own path against a plain copy of the same bytes.

For each model size, a random Llama written by `make_tiny_model` is loaded by the replica's own
backend (inference.backends: CudaBackend on a GPU, VirtualBackend on the CPU) and put to sleep and
woken through its to_cache / from_cache, which pack into and unpack out of the arena
(inference.arena). Bytes per second of weights moved, against a reference copy of the same number
of bytes on the same device in the same run:

- on CUDA: one host-to-device copy from a pinned buffer (the bus's speed: a wake's target is 90 %
  of it), one from a pageable buffer, and one pinned device-to-host copy for the sleep;
- on the CPU: one torch copy of a buffer of that size into another, already touched (a memcpy),
  and into a buffer allocated for it (what a sleep or a wake does at the least).

The first sleep is shown apart: it pays for the arena's allocation and page-locking, which a
later sleep pays again (the arena is freed by every wake, so an awake replica holds no host copy).
"kept sleep" is the same first sleep for a replica the control plane lets keep an arena (the
`arena` command): `keep_arena` set and a spare prepared in advance by the method the
replica host runs in the background (`prepare_spare`, untimed: allocated, page-locked and filled
with a copy of the weights long before the sleep comes), so the sleep copies nothing the replica
left unwritten: a time in ms, as it moves no bytes. "spare prep" is that preparation's own rate
(what the background thread takes, the copy included; on the CPU it faults the pages in). A later
sleep of such a replica packs into the arena its wake kept, which also holds every weight the
replica served from without writing: "sleep after kept wake" times that sleep, which likewise
copies nothing it need not (only what was written or replaced since the wake).
A wake's time ends when its copies have landed (`PendingCopies.wait()`): it no longer includes
freeing the arena, which a pinned arena's wake hands to a background releaser. Each timed wake is
followed, untimed, by `settle_releases()`, so the next sleep does not pay for the last release (a
replica's sleep comes long after its wake), and "host kept", the process's resident memory after
the last wake less before the first sleep, is read once every arena is back: about 0 when the wake
gave the arena back.

A wake allocates the replica's KV pool while its copies run (inference.host, `_wake_onto`):
"wake + pool" times the same wake with a pool as large as the weights allocated between queueing
the copies and waiting for them, and "pool alone" that allocation by itself (after the allocator's
cache was emptied, as a sleep leaves it). On a GPU, "wake + pool" near the wake alone rather than
wake + pool alone shows the overlap; on the CPU the copies are done when they are issued, so the
two simply add up there.

    python -m bench.wake [--device cpu|cuda] [--sizes 64,128,256] [--dtype float32] [--repeats 3]
                         [--host-cache] [--no-record]

Sizes are MiB of float32 weights (0.5, 1 and 4 GiB on CUDA by default; 64, 128 and 256 MiB on the
CPU). The host cache under pressure (sleeping replicas past the node's budget) needs the control
plane: `--host-cache` then runs bench.host_cache's measurement on a stack of its own (embedded
servers unless DATABASE_URL / REDIS_URL are set), recorded in its own section.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import record, table

GB = 1e9  # bandwidth in decimal gigabytes a second, as the findings and the vendors quote it
DEFAULT_SIZES_MB = {"cuda": [512, 1024, 4096], "cpu": [64, 128, 256]}


@dataclass
class Figures:
    size_mb: int
    weights_bytes: int
    first_sleep_s: float
    sleep_s: float
    wake_s: float
    wake_with_pool_s: float  # the copies queued, a KV pool allocated, then the wait
    pool_s: float  # the same pool's allocation alone
    kept_sleep_s: float  # a first sleep into a kept arena prepared and filled in advance (keep_arena)
    resleep_s: float  # a sleep into the arena a wake kept, which holds the weights already
    spare_s: float  # preparing that arena (allocation, page-locking, the copy), off the sleep's path
    reference: dict[str, float]  # name → bytes/s
    host_kept_bytes: int

    def rate(self, seconds: float) -> float:
        return self.weights_bytes / seconds


def resident_bytes() -> int:
    """This process's resident set (VmRSS), from /proc."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def settle() -> None:
    """Wait until the arenas the wakes handed to the background releaser are freed."""
    from inference.arena import settle_releases

    if not settle_releases(timeout=600):
        raise RuntimeError("the arenas' release did not finish within 10 minutes")


def timed(action: Callable[[], Any], device: str) -> float:
    import torch

    began = time.perf_counter()
    action()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began


def best_rate(nbytes: int, copy: Callable[[], Any], device: str, trials: int = 3) -> float:
    copy()  # warm-up: first-touch page faults, driver set-up
    return nbytes / min(timed(copy, device) for _ in range(trials))


def references(nbytes: int, device: str) -> dict[str, float]:
    """Plain copies of `nbytes` on this device: what the bus (or memory) gives without the product."""
    import torch

    if device == "cpu":
        source = torch.ones(nbytes, dtype=torch.uint8)
        target = torch.empty(nbytes, dtype=torch.uint8)
        return {
            "memcpy": best_rate(nbytes, lambda: target.copy_(source), device),
            # What a sleep or a wake does at the least: copy into memory allocated for it, whose
            # pages fault in on first touch.
            "fresh memcpy": best_rate(nbytes, lambda: torch.empty_like(source).copy_(source), device),
        }
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    pinned = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    rates = {
        "pinned H2D": best_rate(nbytes, lambda: gpu.copy_(pinned, non_blocking=True), device),
        "pageable H2D": best_rate(nbytes, lambda: gpu.copy_(pageable), device),
        "pinned D2H": best_rate(nbytes, lambda: pinned.copy_(gpu, non_blocking=True), device),
        **fresh_arena_rates(nbytes),
    }
    gpu = pinned = pageable = None  # freed before the next model loads
    torch.cuda.empty_cache()
    return rates


def fresh_arena_rates(nbytes: int) -> dict[str, float]:
    """What a first sleep with no arena prepared pays before its copy, phase by phase, through the
    arena's own allocation (inference.arena): its pages faulted in (`fault-in`, huge pages asked
    for), then those and their page-locking (`fault-in + pin`); beside them, the same bytes faulted
    in by a plain allocation (`plain fault-in`: whether asking for huge pages pays on this
    machine). Each timed once on fresh memory, as a sleep meets it."""
    import torch

    from inference.arena import _host_buffer, _populated_pages

    began = time.perf_counter()
    torch.empty(nbytes, dtype=torch.uint8).zero_()
    plain = time.perf_counter() - began
    began = time.perf_counter()
    host = _populated_pages(nbytes)
    fault_in = time.perf_counter() - began
    del host
    began = time.perf_counter()
    host, unpin = _host_buffer(nbytes, pin=True)
    pinned = time.perf_counter() - began
    if unpin is not None:
        unpin()
    del host
    return {"plain fault-in": nbytes / plain, "fault-in": nbytes / fault_in, "fault-in + pin": nbytes / pinned}


def kv_pool(model: Any, weights: int, device: str) -> Any:
    """A KV block pool of about the weights' bytes, for `model`'s shape, on the first GPU (or the CPU)."""
    from gpuportal.wire import memory
    from inference.kvpool import BlockPool
    from inference.paged import model_shape

    shape = model_shape(model, weights)
    blocks = max(1, weights // memory.kv_block_bytes(shape, memory.DEFAULT_BLOCK_TOKENS))
    dtype = next(model.parameters()).dtype
    target = "cuda:0" if device == "cuda" else "cpu"
    return BlockPool.for_shape(shape, blocks, dtype=dtype, device=target, block_tokens=memory.DEFAULT_BLOCK_TOKENS)


def wake_with_pool(backend: Any, model: Any, placement: Any, weights: int, device: str) -> None:
    """What a replica's wake does: queue the copies, allocate the pool while they run, wait once."""
    woken, copies = backend.from_cache(model, placement)
    try:
        pool = kv_pool(woken, weights, device)
    finally:
        copies.wait()
    pool.release()


def pool_alone(model: Any, weights: int, device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()  # as a sleep leaves the allocator: the pool's memory is allocated anew
    return timed(lambda: kv_pool(model, weights, device).release(), device)


def kept_sleeps(
    backend: Any, model: Any, placement: Any, repeats: int, device: str
) -> tuple[list[float], list[float], list[float]]:
    """(preparations, first sleeps, sleeps after a kept wake) of a replica allowed to keep an arena,
    `repeats` times. Each spare is prepared afresh, as a replica's is when it is told it may keep
    one; the sleep after the wake packs into the arena the wake kept; then it is dropped."""

    def wake_keeping() -> None:
        _, copies = backend.from_cache(model, placement)
        copies.wait()
        backend.collect_kept(copies)

    backend.keep_arena = True
    prepared, slept, again = [], [], []
    for _ in range(repeats):
        prepared.append(timed(lambda: backend.prepare_spare(model), device))
        slept.append(timed(lambda: backend.to_cache(model, placement), device))
        wake_keeping()
        again.append(timed(lambda: backend.to_cache(model, placement), device))
        wake_keeping()
        backend.drop_spare()
        settle()
    backend.keep_arena = False
    return prepared, slept, again


def measure(size_mb: int, device: str, dtype: str, repeats: int, work: Path) -> Figures:
    import torch

    from inference.backends import CudaBackend, Placement, VirtualBackend
    from inference.loaders import tensor_bytes
    from inference.management.commands.make_tiny_model import write_tiny_model

    target = work / f"llama-{size_mb}"
    target.mkdir()
    path = write_tiny_model(target, size_mb=size_mb, seed=0, log=lambda _: None).path
    backend: Any = CudaBackend() if device == "cuda" else VirtualBackend()
    room = torch.cuda.mem_get_info(0)[1] if device == "cuda" else 64 * 1024**3
    placement = Placement.parse([0], {"0": room}, None)  # no cap: the bench measures copies, not limits
    backend.attach(placement)
    model = backend.load(str(path), "transformers", dtype, placement)
    weights = tensor_bytes(model)
    shutil.rmtree(path, ignore_errors=True)

    with torch.no_grad():  # weights read from a memory-mapped checkpoint are resident only once touched
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.sum()
    before = resident_bytes()
    sleeps, wakes, pooled, pools = [], [], [], []
    for _ in range(repeats):
        sleeps.append(timed(lambda: backend.to_cache(model, placement), device))
        # The copies landed: the wake's time. The arena's release, in the background, is not in it.
        wakes.append(timed(lambda: backend.from_cache(model, placement)[1].wait(), device))
        settle()  # untimed: the next sleep starts with the host memory back, as a replica's would
    kept = resident_bytes() - before  # before the pools: what the host's allocator keeps of them is not the arena
    for _ in range(repeats):
        backend.to_cache(model, placement)
        pooled.append(timed(lambda: wake_with_pool(backend, model, placement, weights, device), device))
        settle()
        pools.append(pool_alone(model, weights, device))
    spares, kept_sleeps_s, resleeps_s = kept_sleeps(backend, model, placement, repeats, device)
    model = None  # its memory goes back before the reference copies allocate theirs
    backend.release()
    return Figures(
        size_mb=size_mb,
        weights_bytes=weights,
        first_sleep_s=sleeps[0],
        sleep_s=statistics.median(sleeps[1:] or sleeps),
        wake_s=statistics.median(wakes),
        wake_with_pool_s=statistics.median(pooled),
        pool_s=statistics.median(pools),
        kept_sleep_s=statistics.median(kept_sleeps_s),
        resleep_s=statistics.median(resleeps_s),
        spare_s=statistics.median(spares),
        reference=references(weights, device),
        host_kept_bytes=kept,
    )


def rows(figures: list[Figures], device: str) -> tuple[list[str], list[list[object]]]:
    def gbs(rate: float) -> str:
        return f"{rate / GB:.1f}"

    if device == "cuda":
        headers = [
            "model",
            "first sleep GB/s",
            "kept sleep ms",
            "spare prep GB/s",
            "sleep after kept wake ms",
            "sleep GB/s",
            "wake GB/s",
            "wake + pool GB/s",
            "pool alone ms",
            "pinned H2D GB/s",
            "pageable H2D GB/s",
            "wake / pinned",
            "pinned D2H GB/s",
            "sleep / D2H",
            "plain fault-in GB/s",
            "fresh arena: fault-in GB/s",
            "fault-in + pin GB/s",
            "host kept",
        ]
    else:
        headers = ["model", "first sleep GB/s", "kept sleep ms", "spare prep GB/s", "sleep after kept wake ms"]
        headers += ["sleep GB/s", "wake GB/s"]
        headers += ["wake + pool GB/s", "pool alone ms"]
        headers += ["memcpy GB/s", "fresh memcpy GB/s"]
        headers += ["wake / fresh", "sleep / fresh", "host kept"]
    out: list[list[object]] = []
    for f in figures:
        sleep, wake = f.rate(f.sleep_s), f.rate(f.wake_s)
        row: list[object] = [f"{f.weights_bytes / 1024**2:.0f} MiB", gbs(f.rate(f.first_sleep_s))]
        row += [f"{f.kept_sleep_s * 1000:.1f}", gbs(f.rate(f.spare_s)), f"{f.resleep_s * 1000:.1f}", gbs(sleep)]
        row += [gbs(wake), gbs(f.rate(f.wake_with_pool_s)), f"{f.pool_s * 1000:.1f}"]
        if device == "cuda":
            pinned, d2h = f.reference["pinned H2D"], f.reference["pinned D2H"]
            row += [gbs(pinned), gbs(f.reference["pageable H2D"]), f"{wake / pinned:.0%}", gbs(d2h)]
            row.append(f"{sleep / d2h:.0%}")
            row += [gbs(f.reference[k]) for k in ("plain fault-in", "fault-in", "fault-in + pin")]
        else:
            fresh = f.reference["fresh memcpy"]
            row += [gbs(f.reference["memcpy"]), gbs(fresh), f"{wake / fresh:.0%}", f"{sleep / fresh:.0%}"]
        row.append(f"{f.host_kept_bytes / 1024**2:+.0f} MiB")
        out.append(row)
    return headers, out


def describe_device(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return f"CPU, torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s) (VirtualBackend's setting)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--sizes", default="", help="MiB of float32 weights, comma-separated")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="sleep/wake cycles per model (medians reported)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument(
        "--host-cache",
        action="store_true",
        help="then the host cache under pressure on a running stack (bench.host_cache, its own section)",
    )
    args = parser.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda, but this torch {torch.__version__} cannot use a GPU here")
    sizes = [int(s) for s in args.sizes.split(",") if s] or DEFAULT_SIZES_MB[device]
    with tempfile.TemporaryDirectory(prefix="bench-wake-") as work:
        figures = [measure(size, device, args.dtype, max(1, args.repeats), Path(work)) for size in sizes]
    headers, body_rows = rows(figures, device)
    result = table(headers, body_rows)
    print(result)
    if not args.no_record:
        record_copies(args, device, result)
    if args.host_cache:
        from bench import host_cache

        host_cache.run(record_it=not args.no_record)


def record_copies(args: argparse.Namespace, device: str, result: str) -> None:
    import torch

    if device == "cuda":
        reference = (
            "one copy of the same bytes in the same process: pinned and pageable host-to-device, pinned "
            "device-to-host (best of 3). Targets: wake ≥ 90 % of pinned H2D, first sleep ≥ 20 GB/s "
            "(`kept sleep`, the first sleep of a replica allowed to keep an arena, is a time in ms: its arena "
            "was filled in advance, so it copies only what was written since). `fresh arena`: what a first "
            "sleep with no arena prepared pays before its copy, through the arena's own allocation "
            f"(inference.arena, {torch.get_num_threads()} intra-op threads): its pages faulted in, then "
            "faulted in and page-locked, once each on fresh memory; `plain fault-in`: a plain allocation's pages "
            "faulted in, without asking for huge pages"
        )
    else:
        reference = (
            "one torch copy of a buffer of the same bytes into a buffer already touched (`memcpy`) and into "
            "one allocated for it (`fresh memcpy`), best of 3. On the CPU a sleep and a wake are host-to-host "
            "copies into a fresh allocation (the arena, then the woken weights), so both are bound by "
            "first-touch page faults, as `fresh memcpy` is; this checks the arena's own overhead, not what a "
            "GPU does. The machine is shared with other work (2 cores): figures vary from run to run"
        )
        if not torch.cuda.is_available():
            reference += ". No GPU here: the CUDA figures (their own section) need `--device cuda` on one"
    body = (
        f"Random Llama models (`make_tiny_model`, {args.dtype}) loaded by the replica's backend on "
        f"{describe_device(device)}; sleep and wake through its to_cache / from_cache (inference.arena), "
        f"{args.repeats} cycles each: the first sleep apart, medians of the rest. Reference: {reference}. "
        "`kept sleep`: a first sleep of a replica allowed to keep an arena (`keep_arena`, its spare "
        "prepared in advance by `prepare_spare`, as the replica host does in the background when told: allocated, "
        "page-locked and filled with a copy of the weights, so the sleep copies nothing not written since), "
        f"median of {args.repeats}, in ms; `spare prep`: that preparation's rate (allocation and page-locking, "
        "or on the CPU faulting the pages in, and the copy), off the sleep's path. "
        "`sleep after kept wake`: the next sleep of that replica, into the arena its wake kept, which still "
        "holds every weight not written since (inference.arena copies only what was), median of "
        f"{args.repeats}, in ms. "
        "`wake + pool`: the wake with a KV pool of the weights' size allocated while its copies run (the "
        "replica's order), `pool alone`: that allocation by itself; on a GPU the overlap shows as `wake + pool` "
        "near `wake`, on the CPU the copies are synchronous and the two add up. "
        "`wake`: until the copies have landed; a pinned arena is then freed in the background, outside "
        "the figure (each wake is followed, untimed, by waiting for that release). "
        "`host kept`: resident memory after the last wake, its arena released, less before the first sleep. "
        "The host cache under pressure (sleeping replicas past the node's budget) needs the control "
        "plane: `--host-cache` measures it after these, in the same run (bench.host_cache, its own "
        "section).\n\n"
        f"{result}\n"
    )
    # One section per device kind: a GPU run does not replace the CPU figures, nor the reverse.
    record(f"wake-{device}", f"Sleep and wake bandwidth on {device} (bench.wake)", body)


if __name__ == "__main__":
    main()
