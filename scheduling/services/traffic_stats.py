"""How each deployment's requests fared over a recent window, read from the recorded traffic
(RequestRecord, drained from Redis each minute by scheduling.services.traffic): how many ended
and how, the latency and time-to-first-token percentiles, the wait for a replica, and the tokens
generated. What `GET /api/traffic/`, `gpuportal stats`, the dashboard's p95 and the latency
series of /metrics show.

The percentiles are PostgreSQL's (`percentile_cont`, interpolated), computed where the rows are:
a busy hour is hundreds of thousands of records, which no scrape should read into Python."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import connection
from django.utils import timezone

from gpuportal.wire.requestqueue import COUNT_KIND
from scheduling.models import RequestRecord

# The window /metrics reports on: a few scrapes' worth, as a Prometheus summary's would be.
METRICS_WINDOW_S = 300.0


@dataclass(frozen=True)
class Quantiles:
    p50: float
    p95: float
    p99: float


@dataclass(frozen=True)
class TrafficStats:
    """One deployment's requests accepted in the window that have ended (and been recorded).

    `latency_s`: from acceptance to the answer, of those done; `ttft_s`: from acceptance to the
    first token, of the generations a batching replica did; `queue_s`: from acceptance to a
    replica taking it (a wake or a load included), of those a replica took; `per_output_token_s`:
    a done request's time on its replica divided by the tokens it generated (its prefill
    included). None where no request had that figure."""

    deployment: str
    window_s: float
    done: int
    failed: int
    cancelled: int
    latency_s: Quantiles | None
    ttft_s: Quantiles | None
    queue_s: Quantiles | None
    per_output_token_s: Quantiles | None
    output_tokens: int

    @property
    def ended(self) -> int:
        return self.done + self.failed + self.cancelled

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.window_s


_QUANTILES = "ARRAY[0.5, 0.95, 0.99]"
_STATS_SQL = f"""
SELECT deployment,
       count(*) FILTER (WHERE status = 'done'),
       count(*) FILTER (WHERE status = 'failed'),
       count(*) FILTER (WHERE status = 'cancelled'),
       percentile_cont({_QUANTILES}) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - created_at))
           FILTER (WHERE status = 'done' AND finished_at IS NOT NULL),
       percentile_cont({_QUANTILES}) WITHIN GROUP (ORDER BY extract(epoch FROM first_token_at - created_at))
           FILTER (WHERE first_token_at IS NOT NULL),
       percentile_cont({_QUANTILES}) WITHIN GROUP (ORDER BY extract(epoch FROM started_at - created_at))
           FILTER (WHERE started_at IS NOT NULL),
       percentile_cont({_QUANTILES})
           WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at) / output_tokens)
           FILTER (WHERE status = 'done' AND output_tokens > 0 AND started_at IS NOT NULL AND finished_at IS NOT NULL),
       coalesce(sum(output_tokens) FILTER (WHERE status = 'done'), 0)
FROM {RequestRecord._meta.db_table}
WHERE created_at >= %s AND kind <> '{COUNT_KIND}' {{only}}
GROUP BY deployment
ORDER BY deployment
"""  # the table's name is the model's; every value goes as a parameter


def stats(window_s: float, *, deployment: str | None = None, now: datetime | None = None) -> list[TrafficStats]:
    """Each deployment with a request recorded in the last `window_s` seconds, by name."""
    since = (now or timezone.now()) - timedelta(seconds=window_s)
    params: list[object] = [since]
    only = ""
    if deployment:
        only, params = "AND deployment = %s", [since, deployment]
    with connection.cursor() as cursor:
        cursor.execute(_STATS_SQL.format(only=only), params)
        rows = cursor.fetchall()
    return [
        TrafficStats(
            deployment=name,
            window_s=window_s,
            done=done,
            failed=failed,
            cancelled=cancelled,
            latency_s=_quantiles(latency),
            ttft_s=_quantiles(ttft),
            queue_s=_quantiles(queue),
            per_output_token_s=_quantiles(per_token),
            output_tokens=int(tokens),
        )
        for name, done, failed, cancelled, latency, ttft, queue, per_token, tokens in rows
    ]


def _quantiles(values: list[float] | None) -> Quantiles | None:
    if not values or values[0] is None:
        return None
    # A clock step between two processes' stamps could make a span negative: none is.
    p50, p95, p99 = (max(0.0, float(v)) for v in values)
    return Quantiles(p50, p95, p99)
