"""How an adopted replica ended: `up`, the subreaper of what it starts, reaps the orphans of its
agents' process groups and records each one's exit status, which the adopting agent reads
(gpuportal.orphans). Here a small stand-in for `up` plays its part: a subreaper whose "agent"
starts a long-lived grandchild in its own process group and dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpuportal import orphans
from inference.supervisor import AdoptedProcess, describe_exit

pytestmark = pytest.mark.slow

# A subreaper (as `up`) whose child (as an agent, in a session of its own) starts a grandchild
# and exits; and a second child that just exits, which it waits for itself (as `up` does the
# processes it starts) and must be left to that wait. It reaps until told to stop.
STAND_IN = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from pathlib import Path
    from gpuportal import orphans

    exits = Path(sys.argv[1])
    orphans.become_subreaper(exits)
    agent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; print(subprocess.Popen(['sleep', '60']).pid, flush=True)"],
        stdout=subprocess.PIPE, start_new_session=True, text=True,
    )
    grandchild = int(agent.stdout.readline())
    agent.wait()
    other = subprocess.Popen(["true"], start_new_session=True)
    print(json.dumps({"grandchild": grandchild, "other": other.pid}), flush=True)
    reaped = {}
    while not (exits / "stop").exists():
        reaped.update(orphans.reap({other.pid}, {agent.pid}, exits))
        time.sleep(0.05)
    other_stat = Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    print(json.dumps({"reaped": reaped, "other_state": other_stat}), flush=True)
    orphans.stop_reaping(exits)
    """
)


def test_an_orphan_of_an_agents_group_is_reaped_and_its_adopter_reads_how_it_ended(tmp_path):
    exits = tmp_path / "exits"
    up = subprocess.Popen([sys.executable, "-c", STAND_IN, str(exits)], stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(up.stdout.readline())
        adopted = AdoptedProcess(started["grandchild"], exits)
        # What `up` keeps there, only its owner reads (its records are written the same way).
        assert exits.stat().st_mode & 0o777 == 0o700
        assert (exits / orphans.REAPER_FILE).stat().st_mode & 0o777 == 0o600

        os.kill(started["grandchild"], signal.SIGKILL)

        code = adopted.wait(10)
        assert code == -signal.SIGKILL and describe_exit(code) == "exited with code -9 (signal SIGKILL)"
        assert adopted.wait(0) == code, "asked again, the same answer"
        assert not (exits / f"{started['grandchild']}.json").exists(), "a record is read once"
        adopted.close()
    finally:
        (exits / "stop").touch()
        ended = json.loads(up.stdout.readline())
        up.wait(10)
    assert list(ended["reaped"]) == [str(started["grandchild"])]
    assert ended["other_state"] == "Z", "a child it started itself is left to its own wait"
    assert not (exits / orphans.REAPER_FILE).exists()


def test_without_a_reaper_an_adopters_wait_ends_at_once_with_no_code(tmp_path):
    exits = tmp_path / "exits"
    exits.mkdir()
    (exits / "4242.json").write_text(json.dumps({"pid": 4242, "code": 1, "at": 0}))

    assert orphans.exit_code(exits, 4242, wait_s=30) is None, "no reaper: a record is not waited for, nor trusted"
    assert orphans.exit_code(None, 4242) is None


def test_a_record_older_than_a_pid_lives_is_not_read_and_is_swept(tmp_path):
    exits = tmp_path / "exits"
    exits.mkdir()
    (exits / orphans.REAPER_FILE).write_text(str(os.getpid()))  # this process stands in for the reaper
    stale = exits / "77.json"
    stale.write_text(json.dumps({"pid": 77, "code": 0, "at": 0}))
    fresh = exits / "78.json"
    fresh.write_text(json.dumps({"pid": 78, "code": 3, "at": time.time()}))

    assert orphans.exit_code(exits, 78, wait_s=0) == 3
    assert orphans.exit_code(exits, 77, wait_s=0) is None
    (exits / "79.json").write_text("{}")
    os.utime(exits / "79.json", (0, 0))
    orphans.sweep(exits)
    assert sorted(p.name for p in Path(exits).iterdir()) == [orphans.REAPER_FILE]
