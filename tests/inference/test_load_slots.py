"""At most N replicas of a node load at once: a load past the limit waits for a slot,
saying so, and a load that died frees its slot with no one to clean up after it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from inference.load_slots import from_environment, load_slot

ROOT = Path(__file__).resolve().parents[2]


def test_a_load_past_the_limit_waits_saying_so_until_a_slot_is_free(tmp_path):
    first_holds, first_may_go, second_waits = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        with load_slot(tmp_path, 1):
            first_holds.set()
            first_may_go.wait(30)
            order.append("first done")

    def second() -> None:
        first_holds.wait(30)
        with load_slot(tmp_path, 1, on_wait=second_waits.set):
            order.append("second loads")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    assert second_waits.wait(30), "the second load said it waits for a slot"
    assert order == []
    first_may_go.set()
    for thread in threads:
        thread.join(30)
    assert order == ["first done", "second loads"]


def test_two_slots_let_two_loads_run_at_once(tmp_path):
    with load_slot(tmp_path, 2) as one, load_slot(tmp_path, 2, on_wait=lambda: None) as other:
        assert {one, other} == {0, 1}


@pytest.mark.slow
def test_a_load_that_died_frees_its_slot_at_once(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pathlib import Path\n"
            "from inference.load_slots import load_slot\n"
            "with load_slot(Path(sys.argv[1]), 1):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(120)\n",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        holder.kill()  # a crash in the middle of a load
        holder.wait(10)
        waited: list[bool] = []
        with load_slot(tmp_path, 1, on_wait=lambda: waited.append(True)) as slot:
            assert slot == 0 and waited == []
    finally:
        if holder.poll() is None:
            holder.kill()


def test_without_a_directory_or_a_limit_nothing_waits(tmp_path):
    with load_slot(None, 4) as slot:
        assert slot is None
    with load_slot(tmp_path, 0) as slot:
        assert slot is None
    assert from_environment({"GPUPORTAL_LOAD_SLOTS_DIR": str(tmp_path), "GPUPORTAL_MAX_LOADS": "3"}) == (tmp_path, 3)
    assert from_environment({}) == (None, 0)


@pytest.mark.slow
def test_a_replica_process_waits_for_its_nodes_load_slot_before_it_loads(tmp_path):
    from inference.supervisor import Supervisor
    from tests.support.replicas import TINY_MLP, Events, spec

    slots = tmp_path / "slots"
    supervisor = Supervisor(
        tmp_path / "logs", env={**os.environ, "GPUPORTAL_LOAD_SLOTS_DIR": str(slots), "GPUPORTAL_MAX_LOADS": "1"}
    )
    events = Events()
    try:
        with load_slot(slots, 1):  # another replica of the node is loading
            supervisor.start(spec(TINY_MLP, loader="torch-module"), events)
            waiting = []
            while not waiting:
                event = events.next(60)
                assert event["event"] == "progress", event
                if "waiting for a load slot" in event["detail"]:
                    waiting.append(event)
            assert waiting[0]["detail"] == "waiting for a load slot: this node loads at most 1 at once"
        _, serving = events.until("serving")
        assert serving["weights_bytes"] > 0
    finally:
        supervisor.stop_all(timeout=5)
