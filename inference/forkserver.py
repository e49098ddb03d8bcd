"""A warm template for a node's replica processes: one process per agent that imports torch,
transformers and the replica program once, then forks a replica whenever the agent asks.

A fresh interpreter pays those imports on every replica start (2-4 s of CPU each: torch alone is
more than a second), and a node starts replicas often: scale-ups, replacements, preemptions. A
forked replica starts from the imported modules and shares their pages with its siblings. It
runs the same `inference.replica.main` as `python -m inference.replica`, with the same arguments,
environment and file descriptors; only the work before `main` is skipped.

Forking is safe here because the template stays a single thread that has touched no device: no
CUDA context (each replica makes its own after the fork), no thread pool, no lock another thread
could hold across the fork. Its random generators are seeded again in every child, so that no two
replicas sample alike.

The agent's side (`ForkServer`, `ForkedProcess`) is a small Popen: the replica's pid, its pipes,
`wait`, `poll`, `kill`. The exit code comes from the template, which is the replica's parent and
reaps it; the agent watches the process itself through a pidfd, as it watches an adopted one.

Protocol, over a SOCK_SEQPACKET socket pair, one JSON object a message:
    template → agent  {"ready": pid} once its imports are done
    agent → template  {"argv": [...], "env": {...}, "tie": bool, "name": str} with the child's
                      stdin, stdout and stderr passed as ancillary data (SCM_RIGHTS); `tie`: the
                      child dies with the template (PR_SET_PDEATHSIG), as a replica without an
                      adoption window dies with its agent; `name`: what `ps -o comm` shows of it
    template → agent  {"pid": n} or {"error": "..."}, one per start, in order
    template → agent  {"exit": pid, "code": c} when a child ends (c negative: the signal)
The template dies with its agent (PR_SET_PDEATHSIG) and exits when the agent closes its end.

A node may also run its templates as a service of its own, `python -m inference.forkserver
--listen PATH`, and point its agents at it (GPUPORTAL_REPLICA_TEMPLATE_SOCKET=PATH). The service
imports once; each agent that connects gets a template forked from it, which speaks the protocol
above to that agent alone, leads a process group of its own with the replicas it forks, and exits
when that agent closes the connection or dies. Its imports are done before the agent needs them,
and agents started one after another (a restart, several on one host, a test suite's) pay them
once. The service prints `template PID` for each template it forks. What the imports read of the
environment (huggingface_hub its cache's place) is the service's: it runs with its agents'.

Django-free, like the replica it forks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from gpuportal.processes import die_with_parent, name_this_process, tie_to_parent

log = logging.getLogger(__name__)

# A start's arguments and environment fit well within one message; a socket pair's buffer
# bounds it anyway.
MAX_MESSAGE = 1 << 20
# How long the agent waits for the template's imports before it starts replicas the plain way.
READY_TIMEOUT_S = 120.0
# How long a start waits for the template to answer with the child's pid.
START_TIMEOUT_S = 30.0
# How long after its process is gone a replica's exit code may take to arrive from the template.
EXIT_CODE_GRACE_S = 5.0


# -- the template (its own process) ----------------------------------------------------------------


def _preload() -> None:
    """What every replica imports before it does anything: the replica program (its backends,
    host and serving loop), torch and the model classes the tiny and the common models use."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import inference.replica  # noqa: F401

    for module in (
        "transformers.models.auto.modeling_auto",
        "transformers.models.llama.modeling_llama",
        "transformers.models.bert.modeling_bert",
        "safetensors.torch",
    ):
        with contextlib.suppress(Exception):  # a model class this transformers lacks loads later
            __import__(module)


def serve(channel: socket.socket) -> None:
    """The template's loop: fork on each start, reap each child, say when one ends."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    # SIGCHLD wakes the select below through the pipe: no thread, so nothing is held across a fork.
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    template = os.getpid()
    _send(channel, {"ready": template})
    while True:
        ready, _, _ = select.select([channel, wake_r], [], [], 1.0)
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(channel)
        if channel not in ready:
            continue
        message, fds, _flags, _addr = socket.recv_fds(channel, MAX_MESSAGE, 3)
        if not message:
            return  # the agent is gone
        try:
            start = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
        except Exception as exc:  # a bad message, or no memory to fork: the agent falls back
            _send(channel, {"error": f"{type(exc).__name__}: {exc}"})
            _close(fds)
            continue
        if pid == 0:
            _child(start, fds, keep_out=(channel.fileno(), wake_r, wake_w), template=template)
        _close(fds)
        _send(channel, {"pid": pid})


def _reap(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            _send(channel, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(start: dict[str, Any], fds: list[int], keep_out: tuple[int, ...], template: int) -> None:
    """In the forked child: become the replica `start` describes. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in keep_out:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        _close([fd for fd in fds if fd > 2])
        if start.get("tie"):
            tie_to_parent(signal.SIGKILL)
            if os.getppid() != template:  # it died between the fork and the tie: no signal will come
                os._exit(1)
        # Its command line stays the template's: its name says which replica it is.
        with contextlib.suppress(Exception):
            name_this_process(f"replica-{start.get('name', '')}")
        os.environ.clear()
        os.environ.update(start["env"])
        _reseed()
        # The replica configures logging for itself (its format names it and its pid).
        logging.root.handlers.clear()
        sys.argv = [sys.argv[0], *start["argv"]]
        from inference.replica import main

        main(list(start["argv"]))
        code = 0
    except SystemExit as exc:  # argparse's refusal of an argument, say
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _reseed() -> None:
    import random

    random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def _send(channel: socket.socket, message: dict[str, Any]) -> None:
    channel.send(json.dumps(message).encode())


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _prepare() -> None:
    _preload()
    # A thread could hold a lock across a fork, and a CUDA context does not survive one: either
    # makes this no template, and the agent starts its replicas the plain way.
    if threading.active_count() != 1:
        sys.exit(f"forkserver: {threading.active_count()} threads after the imports; refusing to fork")
    if sys.modules["torch"].cuda.is_initialized():
        sys.exit("forkserver: CUDA was initialised by the imports; refusing to fork")


def main() -> None:
    if sys.argv[1:2] == ["--listen"] and len(sys.argv) == 3:
        listen(Path(sys.argv[2]))
        return
    channel = socket.socket(fileno=int(sys.argv[1]))
    _prepare()
    serve(channel)


def listen(address: Path) -> None:
    """The templates' service: a template forked for each agent that connects to `address`."""
    # As ForkServer sets it for a template it starts: an import that asks whether CUDA is there
    # gets NVML's answer, which initialises nothing a fork would break.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    _prepare()
    with contextlib.suppress(FileNotFoundError):
        address.unlink()  # a socket file left by a service that died
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(address))
    listener.listen(16)
    print(f"listening on {address}", flush=True)
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # templates whose agents have gone
                pass
        if not ready:
            continue
        channel, _ = listener.accept()
        sys.stdout.flush()
        try:
            pid = os.fork()
        except OSError as exc:  # no memory to fork: its agent, its template gone, starts replicas the plain way
            print(f"cannot fork a template: {exc}", flush=True)
            channel.close()
            continue
        if pid == 0:
            code = 1
            try:
                listener.close()
                # Its own group, with the replicas it forks: whoever stops a node's processes by
                # group stops them, and none of them is in the service's.
                os.setpgid(0, 0)
                serve(channel)
                code = 0
            finally:
                os._exit(code)
        channel.close()
        print(f"template {pid}", flush=True)


# -- the agent's side ------------------------------------------------------------------------------


class ForkedProcess:
    """A replica the template forked: as much of Popen as the supervisor uses. Watched through a
    pidfd (it is the template's child, not ours); its exit code arrives from the template."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes], server: ForkServer):
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._server = server
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already ended (and reaped): only the template's word is left
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None and self._gone(0):
            self._ended_with(self._server.exit_code(self.pid, EXIT_CODE_GRACE_S))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if not self._gone(timeout):
            raise subprocess.TimeoutExpired(f"replica pid {self.pid}", timeout or 0)
        # Two threads may wait at once (a stop, and the reader that reaps): each reads the code,
        # which stays with the server until close(), and the first one read is kept.
        self._ended_with(self._server.exit_code(self.pid, EXIT_CODE_GRACE_S))
        return self.returncode

    def _ended_with(self, code: int | None) -> None:
        if self.returncode is None:
            self.returncode = code

    def send_signal(self, sig: int) -> None:
        if self._pidfd is None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def close(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
        self._server.forget(self.pid)

    def _gone(self, timeout: float | None) -> bool:
        if self._pidfd is None:
            return True
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


class ForkServer:
    """The agent's handle on its template. Thread-safe; `spawn` answers None when the template
    cannot start a replica (not ready, or gone), and the caller starts it the plain way."""

    def __init__(self, channel: socket.socket, process: subprocess.Popen | None = None):
        """Over `channel`, to the template `process` we started, or (None) to one a templates'
        service forked for us (`connect`)."""
        self.process = process
        self._channel = channel
        self._starts: queue.Queue[dict[str, Any]] = queue.Queue()
        self._start_lock = threading.Lock()
        self._ready = threading.Event()
        self._ended = threading.Condition()
        self._codes: dict[int, int] = {}
        self._closed = False
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()

    @classmethod
    def start(cls, python: str, env: dict[str, str], log_path: Path) -> ForkServer:
        """A template of our own: `python -m inference.forkserver`, which dies with us."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Should an import ask torch whether CUDA is there, NVML answers: the CUDA driver's own
        # answer would initialise it, and a child forked after that could not use the GPU.
        template_env = {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                [python, "-m", "inference.forkserver", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                env=template_env,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        theirs.close()
        return cls(ours, process)

    @classmethod
    def connect(cls, address: str) -> ForkServer:
        """A template forked for us by the templates' service at `address` (`--listen`). It ends
        when we close the connection, or die: the kernel closes it then."""
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            channel.connect(address)
        except OSError:
            channel.close()
            raise
        return cls(channel)

    def ready(self, timeout: float) -> bool:
        """Whether the template said it is ready (or died: then `alive` is False) within `timeout`."""
        return self._ready.wait(timeout)

    @property
    def alive(self) -> bool:
        return not self._closed and (self.process is None or self.process.poll() is None)

    def spawn(
        self, argv: list[str], env: dict[str, str], log_path: Path, *, tie: bool, name: str = ""
    ) -> ForkedProcess | None:
        """Fork `python -m inference.replica *argv` from the template, its stdin and stdout
        pipes to us and its stderr appended to `log_path`, named `replica-<name>` in `ps -o
        comm`; None when the template cannot."""
        if not self._ready.wait(READY_TIMEOUT_S) or not self.alive:
            return None
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        message = json.dumps({"argv": argv, "env": env, "tie": tie, "name": name}).encode()
        try:
            with self._start_lock:
                socket.send_fds(self._channel, [message], [stdin_r, stdout_w, log_fd])
                answer = self._starts.get(timeout=START_TIMEOUT_S)
        except (OSError, queue.Empty) as exc:
            log.warning("the replica template did not start a replica (%s): starting it the plain way", exc)
            _close([stdin_w, stdout_r])
            return None
        finally:
            _close([stdin_r, stdout_w, log_fd])
        if "pid" not in answer:
            log.warning("the replica template refused a start (%s): starting it the plain way", answer.get("error"))
            _close([stdin_w, stdout_r])
            return None
        return ForkedProcess(int(answer["pid"]), os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"), self)

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The child's exit code as the template reaped it; None if the template is gone."""
        deadline = time.monotonic() + timeout
        with self._ended:
            while pid not in self._codes and not self._closed and (left := deadline - time.monotonic()) > 0:
                self._ended.wait(left)
            return self._codes.get(pid)

    def forget(self, pid: int) -> None:
        with self._ended:
            self._codes.pop(pid, None)

    def close(self) -> None:
        """Stop the template. Replicas it forked carry on: each is tied to it only if it was
        to die with its agent, which is stopping them anyway."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._channel.shutdown(socket.SHUT_RDWR)
        if self.process is None:
            return  # a service's template: the connection's end is its end
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)

    def _read(self) -> None:
        while True:
            try:
                raw = self._channel.recv(MAX_MESSAGE)
            except OSError:
                raw = b""
            if not raw:
                break
            message = json.loads(raw)
            if "ready" in message:
                self._ready.set()
            elif "exit" in message:
                with self._ended:
                    self._codes[int(message["exit"])] = int(message["code"])
                    self._ended.notify_all()
            else:
                self._starts.put(message)
        with self._ended:
            self._closed = True
            self._ended.notify_all()
        self._starts.put({"error": "the template is gone"})
        if not self._ready.is_set():
            log.warning("the replica template exited before it was ready: replicas start the plain way")
            self._ready.set()


if __name__ == "__main__":
    main()
