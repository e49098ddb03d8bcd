"""`python -m bench.device_kit [--dir .whl] [--check]`: the wheels a lent GPU machine needs for the
GPU checks (`bench/device_run.sh`: bench.gpu with the `gpu` tests, bench.wake, bench.failover).

The device tool's machines hold PyTorch, transformers, accelerate, nvidia-ml-py and much else under
Python 3.12, but not Django, Celery, psycopg or a Redis client, and they reach nothing outside: what
the project needs beyond their image travels as wheels in the carried folder `.whl` (git-ignored).
This downloads them for CPython 3.12 on manylinux x86_64: the project's dependencies (pyproject.toml)
and the `gpu` tests' pytest-django, less what the image holds, then whatever those require that
neither holds, until nothing is missing; and checks that the folder fits what a call may carry.
`--check` only reads the folder: what is missing, what is there twice, its size. Exit 0: ready.

Then, from the repository root, two `run` calls of the device tool do it all (bench/device_run.sh
says what comes back and where the figures go):

    command: bash bench/device_run.sh gpu             carry: [".whl"]   timeout_s: 540
    command: bash bench/device_run.sh wake failover   carry: [".whl"]   timeout_s: 320
"""

from __future__ import annotations

import argparse
import email.parser
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "3.12"
# pip matches a manylinux tag exactly: every glibc level a wheel of ours was seen built for.
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# What a call may carry, working tree included (the device tool's limit), and what we leave it.
CARRY_LIMIT = 64 * 2**20
TREE_ALLOWANCE = 12 * 2**20
# The image's packages, by the device tool's own list (KINDS.md, read on a machine on 2026-11-17):
# never carried, since a second copy of one shadows the image's and can break what depends on it.
_IMAGE_NAMES = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
    huggingface-hub hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
    lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
    nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
    optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
    simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
    threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
    uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
IMAGE = frozenset(canonicalize_name(n) for n in _IMAGE_NAMES.split())
# Beyond the project's dependencies: what the `gpu` tests' files need (bench.gpu runs only those).
TEST_NEEDS = ("pytest-django>=4.9",)
# The environment a marker is judged in on the device (its python3 is 3.12.3, Linux x86_64).
DEVICE_ENVIRONMENT = {
    **default_environment(),
    "python_version": PYTHON,
    "python_full_version": f"{PYTHON}.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


@dataclass(frozen=True)
class Kit:
    """A folder of wheels as the device would install it."""

    wheels: Mapping[str, Path]  # canonical name → its wheel
    twice: tuple[str, ...]  # names with more than one wheel (pip then refuses the whole install)
    missing: tuple[Requirement, ...]  # required by a wheel here, in neither the folder nor the image
    size: int

    @property
    def ready(self) -> bool:
        return not self.twice and not self.missing and self.size + TREE_ALLOWANCE <= CARRY_LIMIT


def wanted(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """The project's dependencies and the gpu tests' needs that the image does not hold."""
    listed = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [r for r in map(Requirement, [*listed, *TEST_NEEDS]) if canonicalize_name(r.name) not in IMAGE]


def requires(metadata: str, extras: Iterable[str] = ()) -> list[Requirement]:
    """A wheel's Requires-Dist that apply on the device, with the given extras asked for."""
    out = []
    for line in email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        req = Requirement(line)
        applies = req.marker is None or any(
            req.marker.evaluate({**DEVICE_ENVIRONMENT, "extra": extra}) for extra in ("", *extras)
        )
        if applies:
            out.append(req)
    return out


def unmet(asked: Iterable[Requirement], wheels: Mapping[str, Path], have: frozenset[str] = IMAGE) -> list[Requirement]:
    """What `asked` and the wheels' own requirements name that neither the wheels nor `have` hold.
    The extras asked of a wheel bring their requirements in too (psycopg[binary]: psycopg-binary)."""
    extras: dict[str, set[str]] = {}
    for req in asked:
        extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    needs = list(asked)
    for name, wheel in wheels.items():
        needs += requires(_metadata(wheel), extras.get(name, ()))
    seen: set[str] = set()
    out = []
    for req in needs:
        name = canonicalize_name(req.name)
        if name not in wheels and name not in have and name not in seen:
            seen.add(name)
            out.append(req)
    return out


def read(folder: Path, asked: Iterable[Requirement] | None = None) -> Kit:
    found = sorted(folder.glob("*.whl"))
    wheels: dict[str, Path] = {}
    twice = set()
    for wheel in found:
        name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        if name in wheels:
            twice.add(name)
        wheels[name] = wheel
    missing = unmet(wanted() if asked is None else asked, wheels)
    size = sum(w.stat().st_size for w in found)  # every wheel travels, a second of one name too
    return Kit(wheels=wheels, twice=tuple(sorted(twice)), missing=tuple(missing), size=size)


def download(requirements: Iterable[Requirement], folder: Path) -> None:
    """pip download, wheels only, for the device's Python and platforms, without dependencies (the
    caller decides which it needs: most are in the image)."""
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON,
        "--implementation",
        "cp",
        *platforms,
        "--dest",
        str(folder),
        # Name and versions alone: pip would judge a marker here itself, with no extra asked for.
        *(f"{r.name}{r.specifier}" for r in requirements),
    ]
    subprocess.run(argv, check=True)


def fetch(folder: Path, rounds: int = 8) -> Kit:
    folder.mkdir(parents=True, exist_ok=True)
    asked = wanted()
    for _ in range(rounds):
        kit = read(folder, asked)
        if not kit.missing:
            return kit
        print(f"downloading {', '.join(f'{r.name}{r.specifier}' for r in kit.missing)}", flush=True)
        download(kit.missing, folder)
    return read(folder, asked)


def report(kit: Kit) -> str:
    lines = [f"{len(kit.wheels)} wheels, {kit.size / 2**20:.1f} MiB (a call carries {CARRY_LIMIT // 2**20} MiB in all)"]
    if kit.twice:
        lines.append(f"more than one wheel of {', '.join(kit.twice)}: keep one of each (pip refuses the install)")
    if kit.missing:
        lines.append(f"missing: {', '.join(f'{r.name}{r.specifier}' for r in kit.missing)}")
    if kit.size + TREE_ALLOWANCE > CARRY_LIMIT:
        lines.append(f"too large beside the working tree ({TREE_ALLOWANCE // 2**20} MiB allowed for it)")
    if kit.ready:
        lines.append(
            'ready: device runs with carry [".whl"]: "bash bench/device_run.sh gpu" (timeout_s 540), then '
            '"bash bench/device_run.sh wake failover" (timeout_s 320)'
        )
    return "\n".join(lines)


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return z.read(name).decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".whl", help="the carried folder (default .whl)")
    parser.add_argument("--check", action="store_true", help="only read the folder; download nothing")
    args = parser.parse_args(argv)
    if args.check:
        if not args.dir.is_dir():
            parser.error(f"{args.dir} does not exist: run without --check to fill it")
        kit = read(args.dir)
    else:
        kit = fetch(args.dir)
    print(report(kit))
    return 0 if kit.ready else 1


if __name__ == "__main__":
    sys.exit(main())
