"""Deep sleep against the first level and a load from disk, through the replica host's own path.

For each model size, a random Llama written by `make_tiny_model` is served by a ReplicaHost (the
object a replica process runs, inference.host) on the replica's backend (CudaBackend on a GPU,
VirtualBackend on the CPU), side by side in one run:

- `load`: its load from disk (`ReplicaHost.load`), the weights read from the model's files;
- `wake`: a wake from the first level of sleep (`sleep`, then `wake`): the process kept its
  context and its weights sit in its host arena;
- `deepen`: the sleeper writes its weights to the node's host copy (`deepen`, inference.host_copy)
  and lets go of everything; `copy`: the file's size;
- `deep wake`: a new host given that copy (`ReplicaHost(host_copy=...).load()`): the skeleton from
  the model's configuration, the weights from the copy into an arena, then to the device as a wake
  copies them. A replica process must be started first (a forked one on virtual GPUs:
  bench.replica_start measures that apart);
- `GPU asleep` / `GPU deep`: what the process holds on its GPU asleep (its context) and deep asleep
  (nothing: there is no process), from the same model of NVML the agent reports on virtual GPUs,
  NVML itself on a GPU.

Medians of `--repeats` cycles; `deep wake / load` < 1 is the point of the copy.

    python -m bench.deep_sleep [--sizes 64,256] [--repeats 3] [--no-record]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import record, table

MiB = 1024**2
DEFAULT_SIZES_MB = {"cpu": [64, 256], "cuda": [512, 2048]}


@dataclass
class Figures:
    size_mb: int
    weights: int
    load_s: float
    wake_s: float
    deepen_s: float
    copy_bytes: int
    deep_wake_s: float
    gpu_asleep: int


def _reservation(size_mb: int, device: str) -> int:
    """Room for the weights, the KV pool (which takes the rest) and, on virtual GPUs, the context."""
    from gpuportal.wire.memory import H100_CONTEXT_BYTES

    return (H100_CONTEXT_BYTES if device == "cpu" else 0) + 3 * size_mb * MiB + 512 * MiB


def _host(model: Path, device: str, reserved: int, copy: Path | None = None):
    from gpuportal.wire.memory import H100_CONTEXT_BYTES
    from inference.backends import CudaBackend, Placement, VirtualBackend
    from inference.event_stream import EventWriter
    from inference.host import ReplicaHost

    backend = CudaBackend() if device == "cuda" else VirtualBackend()
    return ReplicaHost(
        replica_id="bench",
        source=str(model),
        loader="transformers",
        dtype="float32",
        placement=Placement.parse([0], {"0": reserved}, None),
        backend=backend,
        events=EventWriter(io.StringIO()),
        context_bytes=H100_CONTEXT_BYTES if device == "cpu" else 0,
        host_copy=copy,
    )


def _timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(size_mb: int, device: str, repeats: int, work: Path) -> Figures:
    from inference.management.commands.make_tiny_model import write_tiny_model

    model = write_tiny_model(work / f"llama-{size_mb}", size_mb=size_mb, seed=size_mb, log=lambda _: None).path
    copy = work / "copies" / f"{size_mb}.pt"
    loads, wakes, deepens, deep_wakes, copies, asleep = [], [], [], [], [], []
    weights, reserved = 0, _reservation(size_mb, device)
    for _ in range(repeats):
        host = _host(model, device, reserved)
        loads.append(_timed(host.load))
        weights = host.weights_bytes
        host.sleep()
        wakes.append(_timed(lambda h=host: h.wake([0], {"0": reserved})))
        host.sleep()
        asleep.append(sum((host.process_bytes_by_id() or {}).values()))
        deepens.append(_timed(lambda h=host: h.deepen(str(copy))))
        copies.append(copy.stat().st_size)
        del host
        woken = _host(model, device, reserved, copy)
        deep_wakes.append(_timed(woken.load))
        woken.stop(0)
    return Figures(
        size_mb,
        weights,
        statistics.median(loads),
        statistics.median(wakes),
        statistics.median(deepens),
        max(copies),
        statistics.median(deep_wakes),
        max(asleep),
    )


def rows(figures: list[Figures]) -> tuple[list[str], list[list[object]]]:
    headers = [
        "weights", "load", "wake", "deepen", "copy", "deep wake", "deep wake / load", "deep wake / wake",
        "GPU asleep", "GPU deep",
    ]  # fmt: skip
    body = [
        [
            f"{f.weights / MiB:.0f} MiB",
            f"{f.load_s * 1000:.0f} ms",
            f"{f.wake_s * 1000:.0f} ms",
            f"{f.deepen_s * 1000:.0f} ms",
            f"{f.copy_bytes / MiB:.0f} MiB",
            f"{f.deep_wake_s * 1000:.0f} ms",
            f"{f.deep_wake_s / f.load_s:.2f}",
            f"{f.deep_wake_s / f.wake_s:.1f}",
            f"{f.gpu_asleep / MiB:.0f} MiB",
            "0 MiB",
        ]
        for f in figures
    ]
    return headers, body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--sizes", default="", help="MiB of float32 weights, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [int(s) for s in args.sizes.split(",") if s] or DEFAULT_SIZES_MB[device]
    with tempfile.TemporaryDirectory(prefix="bench-deep-sleep-") as work:
        figures = [measure(size, device, max(1, args.repeats), Path(work)) for size in sizes]
    headers, body = rows(figures)
    result = table(headers, body)
    print(result)
    if args.no_record:
        return
    where = "an NVIDIA GPU (CudaBackend, NVML)" if device == "cuda" else "virtual GPUs (VirtualBackend, its NVML model)"
    record(
        f"deep_sleep_{device}",
        f"Deep sleep ({device})",
        f"Random Llama models (`make_tiny_model`, float32) served by a ReplicaHost on {where}; medians of "
        f"{args.repeats} cycles. `load`: from disk; `wake`: from the first level of sleep (the process kept its "
        "context, its weights in its arena); `deepen`: the sleeper writes the node's host copy "
        "(inference.host_copy) and lets go; `deep wake`: a new host reads the copy (skeleton from the config, "
        "weights into an arena, then to the device), without the replica process's start, which "
        "`bench.replica_start` measures apart. `GPU asleep`: what the sleeper's process holds on its GPU; deep "
        "asleep there is no process."
        + (
            " On virtual GPUs a load from disk maps the model's file, which the page cache holds after its "
            "first read, and copies nothing, while a deep wake copies the weights twice (into an arena, then out "
            "of it, as a wake onto a GPU does): the CPU shows the GPU memory a deep sleeper gives back, not what "
            "its wake costs on a GPU (`--device cuda`, in bench/device_run.sh)."
            if device == "cpu"
            else ""
        )
        + "\n\n"
        + result,
    )


if __name__ == "__main__":
    main()
