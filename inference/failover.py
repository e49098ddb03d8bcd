"""The failover lock (seed 004), held on the pair's own host. Runs inside a replica process (and
the node agent closes pairs with it); no Django, no database.

A failover pair (an active replica and a standby on the same GPUs, so on the same host) shares one
lock: an exclusive `flock` on a file in its node's directory (`<dir>/<fence>.lock`), held by the
replica process on a descriptor of its own. The descriptor IS the lock:

- leader election and resource safety at once: the kernel frees the lock only once every
  descriptor of it is closed, which for the holder means its process has ended, and every byte it
  held on the GPU with it;
- fencing by process death: there is no release call on the failure path;
- nothing to reconnect: a database or network restart cannot drop it, so there is no reconnect
  window to wait out, and the GPU host needs no database credentials for it;
- the persistent half is the lease file beside it (`<fence>.lease`: holder and epoch), which only
  the lock's holder writes: every grant bumps the epoch. The member reports each grant, and the
  control plane keeps holder and epoch in its FailoverLease row from those reports; the pair's
  result fence in Redis refuses results of an older epoch (gpuportal.wire.requestqueue);
- a pair stopped whole is closed first (`<fence>.closed`, written by the node agent before it
  stops the members): a standby granted the lock then leaves it, so it never takes over in the
  moment before its own stop arrives.

Why flock and not a POSIX (fcntl) lock: a POSIX lock belongs to the process and is dropped when the
process closes any descriptor of the file (reading the lease file would release it). Why the
fence names the files: it is unique to the pair's lease, whatever the database's ids do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

log = logging.getLogger("inference.failover")

# The folder of a node's pair locks, under its agent's replica directory.
LOCKS_FOLDER = "failover"


class Claim(Enum):
    TAKE = "take"  # become the holder: bump the epoch
    CLOSED = "closed"  # the pair is being stopped whole: no one takes over (our own stop is on its way)


@dataclass(frozen=True)
class LeaseRow:
    holder: str | None
    epoch: int
    closed: bool = False  # the node's agent stopped the pair whole (`<fence>.closed`)


def decide_claim(row: LeaseRow, me: str) -> Claim:
    """What the holder of a freshly granted lock may do (pure: the tests drive every branch). The
    lock is only ever free once its holder's process has ended, so a grant is a takeover, unless
    the pair is closing (a closing holder never asks again: it holds the lock until it exits)."""
    if row.closed and row.holder != me:
        return Claim.CLOSED
    return Claim.TAKE


@dataclass(frozen=True)
class LeaseConfig:
    folder: Path
    fence: str
    replica_id: str

    @property
    def lock_path(self) -> Path:
        return self.folder / f"{self.fence}.lock"

    @property
    def lease_path(self) -> Path:
        return self.folder / f"{self.fence}.lease"

    @property
    def closed_path(self) -> Path:
        return self.folder / f"{self.fence}.closed"


@dataclass(frozen=True)
class Grant:
    epoch: int
    previous_holder: str | None
    previous_epoch: int
    granted_monotonic: float


class Stale(Exception):
    """This member cannot hold the pair's lock (its lease file is unreadable): it must exit."""


def close_pair(folder: Path, fence: str) -> None:
    """Mark the pair closing (the agent, before it stops the pair whole): whoever is granted the
    lock from now on leaves it. Durable before the stop goes out: the standby reads it under the
    lock, which it can only get once the active has exited."""
    folder.mkdir(parents=True, exist_ok=True)
    path = LeaseConfig(folder, fence, "").closed_path
    with open(path, "w") as marker:
        marker.flush()
        os.fsync(marker.fileno())


def forget_pair(folder: Path, fence: str) -> None:
    """Remove a closed pair's files once its members have exited."""
    config = LeaseConfig(folder, fence, "")
    for path in (config.lease_path, config.lock_path, config.closed_path):
        path.unlink(missing_ok=True)


class FailoverMember:
    """One pair member's side of the lock: `try_acquire` (the primary at start) or `acquire`
    (the standby's wait). Held until the process ends."""

    def __init__(self, config: LeaseConfig, on_event: Callable[..., None] | None = None):
        self.config = config
        self.on_event = on_event or (lambda *a, **k: None)
        self.epoch: int | None = None
        self._fd: int | None = None

    def try_acquire(self) -> Grant | None:
        """Take the lock if it is free and ours to take; None otherwise (without waiting)."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        return self._claimed(fd)

    def acquire(self, stop: threading.Event | None = None) -> Grant:
        """Block until the lock is granted and ours to take (the standby's wait)."""
        stop = stop or threading.Event()
        if not stop.is_set():
            fd = self._open()
            # Blocks in the kernel until the holder's process has ended: woken at once, with no
            # polling delay in the takeover.
            fcntl.flock(fd, fcntl.LOCK_EX)
            if stop.is_set():
                os.close(fd)
            elif (grant := self._claimed(fd)) is not None:
                return grant
            else:
                # Closed, which is for good: not ours, ever. Our own stop is on its way.
                stop.wait()
        raise InterruptedError("stopped while waiting for the failover lock")

    def _claimed(self, fd: int) -> Grant | None:
        """With the lock held: decide, and write the lease file. None (the lock given back): not ours."""
        try:
            return self._claim(fd)
        except BaseException:
            os.close(fd)  # closing the descriptor gives the lock back
            raise

    def _claim(self, fd: int) -> Grant | None:
        cfg = self.config
        row = self._read()
        claim = decide_claim(row, cfg.replica_id)
        if claim is Claim.CLOSED:
            log.info("lock granted, but the pair is being stopped whole: not taking over")
            os.close(fd)
            return None
        epoch = row.epoch + 1
        self._write(cfg.replica_id, epoch)
        self._fd = fd
        self.epoch = epoch
        grant = Grant(epoch, row.holder, row.epoch, time.monotonic())
        self.on_event("grant", epoch=epoch, previous_holder=row.holder, previous_epoch=row.epoch)
        return grant

    def _read(self) -> LeaseRow:
        cfg = self.config
        closed = cfg.closed_path.exists()
        try:
            found = json.loads(cfg.lease_path.read_text())
            if not isinstance(found, dict):
                raise ValueError(f"not an object: {found!r}")
            return LeaseRow(found.get("holder"), int(found.get("epoch") or 0), closed)
        except FileNotFoundError:
            return LeaseRow(None, 0, closed)  # never held
        except (OSError, ValueError, TypeError) as err:
            raise Stale(f"the pair's lease file {cfg.lease_path} cannot be read: {err}") from None

    def _write(self, holder: str, epoch: int) -> None:
        """Whole or not at all (a rename), and durable before the grant is reported: a host that
        crashes right after must not hand out the same epoch twice."""
        path = self.config.lease_path
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        with open(temporary, "w") as out:
            json.dump({"holder": holder, "epoch": epoch}, out)
            out.flush()
            os.fsync(out.fileno())
        temporary.replace(path)

    def _open(self) -> int:
        self.config.folder.mkdir(parents=True, exist_ok=True)
        # O_CLOEXEC: a process this one starts must not inherit the lock and outlive it with it.
        return os.open(self.config.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        """Only on a planned exit; a dying process needs no call: the kernel frees the lock."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
