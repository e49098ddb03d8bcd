"""Deep sleep on the replica's side: a sleeper writes its weights to its node's host copy and lets
go of everything (inference.host_copy, ReplicaHost.deepen); a new process wakes from the copy with
the same weights, never reading the disk. No database: hosts in this process, then one replica
process through its supervisor."""

from __future__ import annotations

import dataclasses
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from inference import host_copy
from inference.backends import CommandRejected, Placement, VirtualBackend
from inference.event_stream import EventWriter
from inference.host import ReplicaHost
from inference.loaders import empty_model, load_model
from inference.supervisor import Supervisor
from tests.support.replicas import CONTEXT, Events, MiB, spec

GiB = 1024**3


class Tied(nn.Module):
    """An embedding tied to its output head, and a rotary-like table that no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(8, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) + self.table)


def _host(model_dir: Path, *, copy: Path | None = None) -> tuple[ReplicaHost, io.StringIO]:
    out = io.StringIO()
    host = ReplicaHost(
        replica_id="r1",
        source=str(model_dir),
        loader="transformers",
        dtype="float32",
        placement=Placement.parse([0], {"0": GiB}, None),
        backend=VirtualBackend(),
        events=EventWriter(out),
        host_copy=copy,
    )
    return host, out


def _events(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _logits(host: ReplicaHost) -> torch.Tensor:
    with torch.no_grad():
        return host.model(torch.tensor([[3, 17, 42, 7, 99]])).logits


def test_a_host_copy_keeps_tied_weights_tied_and_the_tables_no_checkpoint_holds(tmp_path):
    torch.manual_seed(0)
    model = Tied().eval()
    path = tmp_path / "copies" / "r1.pt"

    written = host_copy.save(model, path)

    assert written == path.stat().st_size and path.stat().st_mode & 0o777 == 0o600
    assert not list(path.parent.glob("*.partial")), "the copy is renamed into place whole"
    with torch.device("meta"):
        skeleton = Tied().eval()
    host_copy.assign(skeleton, host_copy.load(path))
    assert skeleton.head.weight is skeleton.embed.weight, "one tensor under two names stays one"
    assert torch.equal(skeleton.table, model.table)
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(skeleton(ids), model(ids))


def test_an_agent_leaving_removes_its_folder_of_host_copies_only_when_it_holds_none(tmp_path):
    empty, holding = tmp_path / "empty", tmp_path / "holding"
    host_copy.save(nn.Linear(2, 2), host_copy.path_of(holding, "r1"))
    empty.mkdir()

    for folder in (empty, holding):
        Supervisor(tmp_path / "logs", host_copies=folder).close()

    assert not empty.exists(), "no empty folder is left in the node's shared memory"
    assert host_copy.held(holding) == ["r1"], "a copy outlives its agent: the next one offers it"


def test_a_copy_written_as_its_folder_is_tidied_away_makes_the_folder_again(tmp_path, monkeypatch):
    folder = tmp_path / "copies"
    opened = host_copy.os.open

    def tidied_first(path, *args):
        # The agent's tidy lands between this process's mkdir and its open.
        host_copy.tidy(Path(path).parent)
        monkeypatch.setattr(host_copy.os, "open", opened)
        return opened(path, *args)

    monkeypatch.setattr(host_copy.os, "open", tidied_first)

    assert host_copy.save(nn.Linear(2, 2), host_copy.path_of(folder, "r1")) > 0
    assert host_copy.held(folder) == ["r1"]


def test_a_host_copy_that_does_not_fit_the_model_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "r1.pt"
    host_copy.save(nn.Linear(4, 2), path)
    with pytest.raises(ValueError, match="'weight' is \\(2, 4\\), the model's \\(3, 4\\)"):
        host_copy.assign(nn.Linear(4, 3), host_copy.load(path))
    with pytest.raises(ValueError, match=r"no tensor 'embed\.weight'"):
        host_copy.assign(Tied(), host_copy.load(path))


def test_a_deep_sleeper_lets_go_of_everything_and_a_new_host_wakes_from_its_copy_with_the_same_answers(
    tiny_model_dir, tmp_path
):
    host, out = _host(tiny_model_dir)
    host.load()
    before = _logits(host)
    host.sleep()
    path = tmp_path / "copies" / "r1.pt"

    host.handle({"cmd": "deepen", "path": str(path)})

    assert host.state == "deep_sleeping" and host.model is None and host.backend.arena is None
    deep = _events(out)[-1]
    assert deep == {"event": "deep_sleeping", "host_copy_bytes": path.stat().st_size}
    # The copy is the weights, no more: one storage, the arena's.
    assert path.stat().st_size < 1.2 * host.weights_bytes + MiB

    woken, woken_out = _host(tiny_model_dir, copy=path)
    woken.load()

    assert woken.state == "serving" and torch.equal(_logits(woken), before)
    assert not path.exists(), "the weights are the process's own now: the node's copy is deleted"
    events = _events(woken_out)
    assert events[-1]["event"] == "serving" and events[-1]["weights_bytes"] == host.weights_bytes
    details = [e["detail"] for e in events if e["event"] == "progress"]
    assert details[0].startswith("waking from deep sleep") and "from the host copy" in details[1]
    assert woken.paged is not None, "it pages its KV cache as a replica loaded from disk does"


def test_a_wake_whose_host_copy_is_gone_loads_from_the_disk(tiny_model_dir, tmp_path):
    reference = load_model(str(tiny_model_dir), "transformers", "float32")
    host, out = _host(tiny_model_dir, copy=tmp_path / "gone.pt")

    host.load()

    assert host.state == "serving"
    with torch.no_grad():
        assert torch.equal(_logits(host), reference(torch.tensor([[3, 17, 42, 7, 99]])).logits)
    assert any("loading weights from" in e.get("detail", "") for e in _events(out))


def test_only_a_sleeper_sleeps_deeply_and_one_that_cannot_write_its_copy_sleeps_on(tiny_model_dir, tmp_path):
    host, out = _host(tiny_model_dir)
    host.load()

    host.handle({"cmd": "deepen", "path": str(tmp_path / "r1.pt")})
    assert _events(out)[-1] == {"event": "error", "cmd": "deepen", "reason": "cannot sleep deeply while serving"}
    assert host.state == "serving" and not (tmp_path / "r1.pt").exists()

    host.sleep()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    host.handle({"cmd": "deepen", "path": str(blocked / "r1.pt")})  # its folder is a file
    assert _events(out)[-1]["reason"].startswith(f"cannot write the host copy {blocked / 'r1.pt'}")
    assert host.state == "sleeping" and host.backend.arena is not None, "its weights are where they were"
    with pytest.raises(CommandRejected, match="path must be a file's path"):
        host.deepen(None)


def test_the_skeleton_of_a_model_holds_no_weights(tiny_model_dir):
    model = empty_model(str(tiny_model_dir), "transformers", "float32")
    assert all(t.is_meta for t in model.parameters())


@pytest.mark.slow
def test_a_replica_process_sleeps_deeply_exits_and_a_process_started_from_its_copy_serves(tiny_model_dir, tmp_path):
    supervisor = Supervisor(tmp_path / "logs", host_copies=tmp_path / "copies")
    try:
        events = Events()
        supervisor.start(spec(str(tiny_model_dir), reserved=CONTEXT + 96 * MiB, fraction=0.03), events)
        _, serving = events.until("serving")
        supervisor.send("r1", {"cmd": "sleep"})
        events.until("sleeping")
        # A waker that takes its GPU whole waits for its process's exit (inference.tasks.wait_released).
        assert supervisor.exited(["r1", "not-here"], timeout=0) == ["r1"], "asleep, it runs still"
        waiter = ThreadPoolExecutor(1).submit(supervisor.exited, ["r1"], 60)

        supervisor.send("r1", {"cmd": "deepen", "path": str(supervisor.host_copy_path("r1"))})

        _, deep = events.until("deep_sleeping")
        assert deep["exit_code"] == 0 and "r1" not in supervisor.running(), "its process is gone"
        assert waiter.result(timeout=60) == [], "its exit wakes the waiter"
        assert supervisor.deep_sleepers() == {
            "r1": {"replica_id": "r1", "pid": 0, "state": "deep_sleeping", "last": "deep_sleeping"}
        }
        woken = dataclasses.replace(spec(str(tiny_model_dir), reserved=CONTEXT + 96 * MiB), from_host_copy=True)
        supervisor.start(woken, events)
        progress, again = events.until("serving")
        assert again["weights_bytes"] == serving["weights_bytes"]
        assert progress[0]["detail"].startswith("waking from deep sleep")
        assert supervisor.deep_sleepers() == {}, "the copy went once the process held the weights"
        assert supervisor.forget_host_copy("r1") is False
    finally:
        supervisor.stop_all(timeout=5)
        supervisor.close()
