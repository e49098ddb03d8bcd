"""A look-up remembered for a few seconds, then trusted a while longer while a thread looks it up
again (stale while it revalidates).

The request path reads two things from PostgreSQL that rarely change: a caller's token and their
request limits. Remembered, a request whose replica needs nothing else from the database never
waits for it; and past their fresh seconds, the answers are still given at once while one thread
per key asks again, so a frozen or restarting database does not hold up every request until it is
back (a request used to wait out the whole freeze)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from django.db import connections

V = TypeVar("V")

# Enough for every live client of a portal; beyond it a cache starts over rather than grow.
MAX_ENTRIES = 10_000


class Remembered(Generic[V]):
    """`fresh_s()` and `stale_s()` are read at each store, so a test or an operator's setting
    change applies to the next one. A look-up in the background that raises one of `forget_on`
    (the token was revoked) forgets the key; any other error keeps what was known until it is
    too stale (the database is unwell)."""

    def __init__(
        self,
        name: str,
        fresh_s: Callable[[], float],
        stale_s: Callable[[], float],
        forget_on: tuple[type[BaseException], ...] = (),
    ):
        self.name = name
        self.fresh_s = fresh_s
        self.stale_s = stale_s
        self.forget_on = forget_on
        self._lock = threading.Lock()
        # key → (trusted without asking until, trusted while asking until, value), time.monotonic().
        self._entries: dict[str, tuple[float, float, V]] = {}
        self._asking: set[str] = set()

    def get(self, key: str, look_up: Callable[[], V]) -> V:
        now = time.monotonic()
        hit = self._entries.get(key)
        if hit is not None and hit[0] > now:
            return hit[2]
        if hit is not None and hit[1] > now:
            self._ask_again(key, look_up)
            return hit[2]
        return self._store(key, look_up())

    def last(self, key: str) -> V | None:
        """What was last known of `key`, however old (for a caller whose look-up just failed)."""
        hit = self._entries.get(key)
        return hit[2] if hit is not None else None

    def forget(self, key: str | None = None) -> None:
        with self._lock:
            if key is None:
                self._entries.clear()
            else:
                self._entries.pop(key, None)

    def _store(self, key: str, value: V) -> V:
        fresh = time.monotonic() + self.fresh_s()
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = (fresh, fresh + self.stale_s(), value)
        return value

    def _ask_again(self, key: str, look_up: Callable[[], V]) -> None:
        with self._lock:
            if key in self._asking:
                return
            self._asking.add(key)
        threading.Thread(target=self._refresh, args=(key, look_up), name=f"{self.name}-look-up", daemon=True).start()

    def _refresh(self, key: str, look_up: Callable[[], V]) -> None:
        # A thread of its own, so a database connection of its own: closed when it is done.
        try:
            self._store(key, look_up())
        except self.forget_on:
            self.forget(key)
        except Exception:
            pass
        finally:
            with self._lock:
                self._asking.discard(key)
            connections.close_all()
