"""Calls of concurrent threads run together (scheduling.group_commit): who runs a batch, what it
holds, and who gets which outcome. No database: the batch is a function of the test's."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from scheduling.group_commit import Group

TIMEOUT = 10


class Recorder:
    """A batch function that records each batch (and the thread that ran it), answers each item
    with its double, or with an item's own error, and can be held in its first batch."""

    def __init__(self, hold_first: bool = False) -> None:
        self.batches: list[list[object]] = []
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def __call__(self, items: list[object]) -> list[object]:
        self.batches.append(list(items))
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return [ValueError(f"bad {item}") if item == "bad" else (item, "done") for item in items]


def started(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name)
    thread.start()
    return thread


def held_then_queued(group: Group, run: Recorder, later: str) -> None:
    """ "a" leads and is held inside its batch while each of `later` queues behind it; then all run."""
    first = started(lambda: group.submit("a"), "caller-a")
    assert run.entered.wait(TIMEOUT)
    others = [started(lambda item=item: group.submit(item), f"caller-{item}") for item in later]
    # Why wait on the group: every later call must be queued behind the held batch before it ends.
    assert group.wait_queued(len(later), TIMEOUT)
    run.release.set()
    for thread in [first, *others]:
        thread.join(TIMEOUT)


def test_a_lone_call_runs_at_once_on_its_own_thread():
    run = Recorder()
    group = Group(run, key=lambda item: item)

    assert group.submit("a") == ("a", "done")
    assert run.batches == [["a"]]
    assert run.threads == [threading.current_thread().name]


def test_calls_that_arrive_during_a_batch_run_together_in_the_next():
    run = Recorder(hold_first=True)
    group = Group(run, key=lambda item: item)
    answers: dict[str, object] = {}

    def call(item: str) -> Callable[[], None]:
        return lambda: answers.__setitem__(item, group.submit(item))

    first = started(call("a"), "caller-a")
    assert run.entered.wait(TIMEOUT)  # "a" leads and is held inside its batch
    others = [started(call(item), f"caller-{item}") for item in "bcd"]
    # Why wait on the group: the three must be queued behind the held batch before it ends.
    assert group.wait_queued(3, TIMEOUT)
    run.release.set()
    for thread in [first, *others]:
        thread.join(TIMEOUT)

    assert run.batches[0] == ["a"]
    assert sorted(run.batches[1]) == ["b", "c", "d"] and len(run.batches) == 2
    assert run.threads[1] in {"caller-b", "caller-c", "caller-d"}, "a waiting caller leads the next batch"
    assert answers == {item: (item, "done") for item in "abcd"}
    assert (group.batches, group.items) == (2, 4)


def test_calls_of_one_key_never_share_a_batch_and_keep_their_order():
    run = Recorder(hold_first=True)
    group = Group(run, key=lambda item: item[0])
    first = started(lambda: group.submit("x0"), "caller-0")
    assert run.entered.wait(TIMEOUT)
    later = []
    for n, item in enumerate(["x1", "y1", "x2"], start=1):
        later.append(started(lambda item=item: group.submit(item), f"caller-{n}"))
        assert group.wait_queued(n, TIMEOUT)  # queued in this order
    run.release.set()
    for thread in [first, *later]:
        thread.join(TIMEOUT)

    assert run.batches == [["x0"], ["x1", "y1"], ["x2"]]


def test_an_items_error_reaches_its_caller_alone():
    run = Recorder(hold_first=True)
    group = Group(run, key=lambda item: item)
    outcomes: dict[str, object] = {}

    def call(item: str) -> None:
        try:
            outcomes[item] = group.submit(item)
        except ValueError as err:
            outcomes[item] = str(err)

    first = started(lambda: call("a"), "caller-a")
    assert run.entered.wait(TIMEOUT)
    others = [started(lambda item=item: call(item), f"caller-{item}") for item in ("bad", "c")]
    assert group.wait_queued(2, TIMEOUT)
    run.release.set()
    for thread in [first, *others]:
        thread.join(TIMEOUT)

    assert outcomes == {"a": ("a", "done"), "bad": "bad bad", "c": ("c", "done")}


def test_a_batch_that_fails_whole_fails_its_callers_and_the_next_batch_still_runs():
    entered, release = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def run(items: list[str]) -> list[object]:
        batches.append(items)
        if len(batches) == 1:
            entered.set()
            assert release.wait(TIMEOUT)
            return [("first", "done")]
        if len(batches) == 2:
            raise RuntimeError("the database went away")
        return [(item, "done") for item in items]

    group = Group(run, key=lambda item: item)
    errors: dict[str, str] = {}

    def call(item: str) -> None:
        try:
            group.submit(item)
        except RuntimeError as err:
            errors[item] = str(err)

    first = started(lambda: call("first"), "caller-first")
    assert entered.wait(TIMEOUT)
    failing = [started(lambda item=item: call(item), f"caller-{item}") for item in ("b", "c")]
    assert group.wait_queued(2, TIMEOUT)
    release.set()
    for thread in [first, *failing]:
        thread.join(TIMEOUT)

    assert errors == {"b": "the database went away", "c": "the database went away"}
    assert group.submit("d") == ("d", "done"), "the lead was handed back after the failure"


def test_a_batch_holds_at_most_its_limit():
    run = Recorder(hold_first=True)
    group = Group(run, key=lambda item: item, limit=2)
    held_then_queued(group, run, "bcde")

    assert [len(batch) for batch in run.batches] == [1, 2, 2]


def test_a_batch_must_answer_every_item():
    group = Group(lambda items: [], key=lambda item: item)

    with pytest.raises(RuntimeError, match="a batch of 1 gave 0 outcomes"):
        group.submit("a")


def _two_in_a_batch(group: Group, run: Recorder) -> None:
    """A held batch of "a", then "b" and "c" together: the group's last batch held two."""
    held_then_queued(group, run, "bc")
    assert run.batches[0] == ["a"] and sorted(run.batches[1]) == ["b", "c"]


def test_a_leader_gathers_as_many_calls_as_its_last_batch_held():
    run = Recorder(hold_first=True)
    # Gathering for longer than the test runs: only the second call's arrival can end it.
    group = Group(run, key=lambda item: item, gather_s=3600)
    _two_in_a_batch(group, run)

    leader = started(lambda: group.submit("d"), "caller-d")
    assert group.wait_queued(1, TIMEOUT)  # "d" leads, and waits for a second call
    follower = started(lambda: group.submit("e"), "caller-e")
    for thread in (leader, follower):
        thread.join(TIMEOUT)

    assert not leader.is_alive() and not follower.is_alive()
    assert sorted(run.batches[2]) == ["d", "e"] and len(run.batches) == 3, "without the gather: [d], [e]"


def test_a_leader_that_gathers_nobody_runs_alone_once_its_gather_is_over():
    run = Recorder(hold_first=True)
    group = Group(run, key=lambda item: item, gather_s=0.01)
    _two_in_a_batch(group, run)

    assert group.submit("d") == ("d", "done")
    assert run.batches[2] == ["d"]


def test_a_lone_caller_never_gathers():
    run = Recorder()
    group = Group(run, key=lambda item: item, gather_s=3600)
    calls = started(lambda: [group.submit(item) for item in "abc"], "lone-caller")
    calls.join(TIMEOUT)

    # A lone caller's last batch held only itself: a gather would hold this thread for an hour.
    assert not calls.is_alive()
    assert run.batches == [["a"], ["b"], ["c"]]
