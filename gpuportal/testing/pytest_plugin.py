"""Real PostgreSQL and Redis for the test session.

With DATABASE_URL and REDIS_URL set, the tests use those servers. Otherwise this plugin starts
embedded ones once per session. It must run before pytest-django imports the settings (which read
the URLs), hence a wrapper around `pytest_load_initial_conftests`, loaded with `-p` from pyproject.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from gpuportal.stack import EmbeddedPostgres, EmbeddedRedis

_started: list[EmbeddedPostgres | EmbeddedRedis] = []
_tmp_dirs: list[Path] = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    # The suite deploys its own `torch-module` factories (tests.support.models, ...), as an
    # operator would list theirs; the processes it starts inherit the setting.
    os.environ.setdefault("GPUPORTAL_TORCH_MODULES", "tests")
    if not os.environ.get("DATABASE_URL") or not os.environ.get("REDIS_URL"):
        root = Path(tempfile.mkdtemp(prefix="gpuportal-test-stack-"))
        _tmp_dirs.append(root)
        if not os.environ.get("DATABASE_URL"):
            pg = EmbeddedPostgres(pgdata=root / "postgres" / "data", durable=False)
            _started.append(pg)
            os.environ["DATABASE_URL"] = pg.start()
        if not os.environ.get("REDIS_URL"):
            rd = EmbeddedRedis(data_dir=root / "redis", persist=False)
            _started.append(rd)
            os.environ["REDIS_URL"] = rd.start()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ["REDIS_URL"] = redis_url_of_worker(os.environ["REDIS_URL"], worker)
    return (yield)


def redis_url_of_worker(url: str, worker: str) -> str:
    """The Redis database of one pytest-xdist worker (`gw0`, `gw1`, ...): the next ones after the
    session's own. PostgreSQL needs nothing of the kind (pytest-django names a test database per
    worker), but Redis holds queues by name: an agent started by one worker's test would take the
    requests and commands of another's."""
    parts = urlsplit(url)
    base = int(parts.path.lstrip("/") or 0)
    db = (base + 1 + int(worker.removeprefix("gw"))) % 16  # Redis's default 16 databases
    return urlunsplit(parts._replace(path=f"/{db}"))


def pytest_report_header(config):
    return [
        f"gpuportal: DATABASE_URL={os.environ.get('DATABASE_URL')} REDIS_URL={os.environ.get('REDIS_URL')}"
        + (" (embedded, this session)" if _started else "")
    ]


def pytest_unconfigure(config):
    while _started:
        _started.pop().stop()
    while _tmp_dirs:
        shutil.rmtree(_tmp_dirs.pop(), ignore_errors=True)


def _why_no_cuda() -> str | None:
    """None when CUDA works here, else the reason `gpu` tests cannot run."""
    from inference.devices import nvidia_gpus

    if not nvidia_gpus():
        return "needs an NVIDIA GPU: NVML finds none on this machine"
    import torch

    if not torch.cuda.is_available():
        return f"needs CUDA: this torch {torch.__version__} build cannot use the GPU NVML sees"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = _why_no_cuda()
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
