"""Steady request load from client threads, for the end-to-end tests of failures under load."""

from __future__ import annotations

import threading

from django.contrib.auth.models import User
from django.db import connection
from rest_framework.test import APIClient


class SteadyLoad:
    """Clients sending /infer/ back to back on their own threads (each its own connection),
    until stopped; every answer is kept."""

    def __init__(self, clients: int = 2):
        self.stop = threading.Event()
        self.results: list[tuple[int, dict]] = []
        self.served = threading.Condition()
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(clients)]

    def __enter__(self) -> SteadyLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _run(self, n: int) -> None:
        client = APIClient()
        client.force_authenticate(User.objects.get(username="ops"))
        try:
            i = 0
            while not self.stop.is_set():
                body = {"input": f"client {n} asks {i}", "params": {"max_tokens": 4}, "timeout_s": 120}
                response = client.post("/api/deployments/tiny/infer/", body, format="json")
                with self.served:
                    self.results.append((response.status_code, response.json()))
                    self.served.notify_all()
                i += 1
        finally:
            connection.close()

    def wait_for(self, count: int, timeout: float = 120) -> None:
        with self.served:
            assert self.served.wait_for(lambda: len(self.results) >= count, timeout), "requests stopped completing"
