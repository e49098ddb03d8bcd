"""The `slow` marker, kept true: a test that starts processes carries it (pytest plugin, registered by
tests/conftest.py).

`make test-fast` runs the tests not marked `slow` as the ones that start no process, and `make test`
hands the files holding `slow` tests out first (tests/conftest.py). Two checks keep the marker right:
at collection, a test that uses a fixture which starts processes must carry it (so also those that
would share processes an earlier test started, and those that skip here, such as the `gpu` ones);
while tests run, an audit hook sees every process the test process starts, and a test without the
marker that starts one fails, naming it.
"""

from __future__ import annotations

import platform
import sys

import pytest

# Fixtures that start processes: tests/conftest.py's, and `supervisor` (tests/inference/test_replica.py).
PROCESS_FIXTURES = frozenset(
    {"agents_worker", "template_service", "start_agent", "agent", "control_worker", "supervisor"}
)

# What starting a process looks like to an audit hook: subprocess (asyncio's, so Playwright's
# browser, included), os.system and os.spawn*, multiprocessing's forks.
PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system", "os.spawn"})


class _Watch:
    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.started: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if event in PROCESS_EVENTS and self.item is not None:
            argv = args[1] if event == "subprocess.Popen" else args
            self.started.append(" ".join(map(str, argv)) if isinstance(argv, list | tuple) else str(argv))

    def check(self) -> None:
        started, self.started = self.started, []
        if started and self.item is not None and not self.item.get_closest_marker("slow"):
            pytest.fail(
                "starts processes but is not marked slow: " + "; ".join(line[:200] for line in started),
                pytrace=False,
            )


_watch = _Watch()


def pytest_configure(config: pytest.Config) -> None:
    # What Python asks the system once per process and keeps (the processor's name: `uname -p`, which
    # the OpenAI client's headers read), asked now: else whichever test first asks is blamed for it,
    # and one file run alone fails where the whole suite, in another order, passes.
    platform.processor()
    if not hasattr(config, "workerinput"):
        # matplotlib's font cache, which it builds (running fc-list) the first time anything plots
        # on a machine: built now, before any worker starts, else a fresh machine's first test to
        # plot is blamed for it. Once built, this is a read of it.
        import matplotlib.font_manager  # noqa: F401
    # Audit hooks cannot be removed: this one records only while a test sets up or runs.
    sys.addaudithook(_watch)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Before -m deselects anything: `make test-fast` refuses what `make test` would.
    unmarked = [
        item.nodeid
        for item in items
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) and not item.get_closest_marker("slow")
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests use fixtures that start processes but are not marked slow:\n  " + "\n  ".join(unmarked)
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    _watch.item, _watch.started = item, []
    result = yield
    _watch.check()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    _watch.check()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    # Stopping what a test started starts nothing; fixtures that end here are not its to answer for.
    _watch.item = None
    return (yield)
