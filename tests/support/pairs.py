"""What a failover pair's members report, made by hand as their processes would (seed 004), for
tests of the control plane with no processes: `report` is the `report` fixture (tests/conftest.py),
one report relayed by the member's node agent, with what it dispatches once committed."""

from __future__ import annotations

from collections.abc import Callable

from gpuportal.wire.memory import MiB
from scheduling.models import FailoverLease, Replica

Report = Callable[..., None]


def stands_by(report: Report, standby: Replica) -> None:
    """A standby's start: weights in host memory, nothing of its own on the GPU (virtual)."""
    report(standby, "failover", state="init")
    report(standby, "standby", pid=5001, weights_bytes=10 * MiB, residual_bytes_by_id={"0": 0})


def serves_at(report: Report, primary: Replica, epoch: int = 1) -> None:
    """A primary that found the pair's lock free: it reports the grant, loads and serves."""
    previous = FailoverLease.objects.get(pk=primary.lease_id).epoch
    report(primary, "failover", state="init")
    report(primary, "lease", what="grant", epoch=epoch, previous_holder=None, previous_epoch=previous)
    report(
        primary,
        "serving",
        pid=4001,
        weights_bytes=10 * MiB,
        epoch=epoch,
        failover_state="active",
        gpu_mem_bytes_by_id=dict(primary.gpu_mem_bytes_by_id),
    )


def takes_over(report: Report, standby: Replica, epoch: int, previous: Replica | None) -> None:
    """The standby got the lock (its active's process ended): it reports the grant, wakes, serves."""
    handed = {"previous_holder": previous.id if previous else None, "previous_epoch": epoch - 1}
    report(standby, "lease", what="grant", epoch=epoch, **handed)
    report(standby, "failover", state="waking", epoch=epoch)
    report(standby, "active", epoch=epoch, takeover_s=0.005, pid=5001, **handed)
