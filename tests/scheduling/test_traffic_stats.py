"""How each deployment's requests fared over a recent window: `GET /api/traffic/`, the latency
series of /metrics, and `gpuportal stats`, all read from the recorded traffic (RequestRecord)."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from gpuportal.cli import app
from scheduling.models import RequestRecord
from scheduling.services import traffic_stats

pytestmark = pytest.mark.django_db

_ids = itertools.count()


def record(
    deployment: str,
    *,
    age_s: float,
    wait_s: float | None = 0.0,
    run_s: float = 1.0,
    status: str = "done",
    tokens: int | None = 10,
    first_token_s: float | None = None,
    now: datetime,
) -> RequestRecord:
    """A request accepted `age_s` ago, taken by a replica `wait_s` later, ended `run_s` after that;
    its first token `first_token_s` after its acceptance."""
    created = now - timedelta(seconds=age_s)
    started = None if wait_s is None else created + timedelta(seconds=wait_s)
    finished = (started or created) + timedelta(seconds=run_s)
    first = None if first_token_s is None else created + timedelta(seconds=first_token_s)
    return RequestRecord.objects.create(
        request_id=f"r{next(_ids)}",
        deployment=deployment,
        kind="generate",
        status=status,
        created_at=created,
        started_at=started,
        finished_at=finished,
        first_token_at=first,
        prompt_tokens=5 if tokens is not None else None,
        output_tokens=tokens,
    )


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(User.objects.create_user("alice"))  # any user, not only staff
    return client


def test_it_reports_each_deployments_counts_latency_wait_and_tokens_over_the_window(api) -> None:
    now = timezone.now()
    # Ten done requests to chat, 1..10 s each from acceptance (a wait of a tenth of it), 20 tokens.
    for n in range(1, 11):
        record("chat", age_s=100 + n, wait_s=n / 10, run_s=n - n / 10, tokens=20, first_token_s=n / 5, now=now)
    record("chat", age_s=50, wait_s=None, run_s=0.5, status="failed", tokens=None, now=now)
    record("chat", age_s=40, wait_s=2.0, run_s=0.1, status="cancelled", tokens=None, now=now)
    record("chat", age_s=400, run_s=99.0, now=now)  # before the window: left out
    record("embed", age_s=10, run_s=0.2, tokens=None, now=now)

    body = api.get("/api/traffic/?window_s=300").json()

    chat, embed = body["results"]
    assert (chat["deployment"], chat["window_s"]) == ("chat", 300.0)
    assert (chat["ended"], chat["done"], chat["failed"], chat["cancelled"]) == (12, 10, 1, 1)
    # PostgreSQL's interpolated percentiles of 1..10 s.
    assert chat["latency_s"] == {"p50": pytest.approx(5.5), "p95": pytest.approx(9.55), "p99": pytest.approx(9.91)}
    # The first token: a fifth of each; none known of the others.
    assert chat["ttft_s"] == {"p50": pytest.approx(1.1), "p95": pytest.approx(1.91), "p99": pytest.approx(1.982)}
    # The wait: the done requests' tenths, and the cancelled one's 2 s (a replica had taken it).
    assert chat["queue_s"]["p50"] == pytest.approx(0.6) and chat["queue_s"]["p99"] == pytest.approx(1.9)
    # Time on the replica over the tokens: 0.9 n / 20.
    assert chat["per_output_token_s"]["p50"] == pytest.approx(0.9 * 5.5 / 20)
    assert chat["output_tokens"] == 200 and chat["output_tokens_per_s"] == pytest.approx(200 / 300)
    # An encoder's answers count no tokens: latency, but no time per token.
    assert (embed["deployment"], embed["done"], embed["per_output_token_s"], embed["ttft_s"]) == (
        "embed",
        1,
        None,
        None,
    )
    assert embed["latency_s"]["p50"] == pytest.approx(0.2)

    only = api.get("/api/traffic/?deployment=embed").json()["results"]
    assert [s["deployment"] for s in only] == ["embed"]
    longer = api.get("/api/traffic/?window_s=3600&deployment=chat").json()["results"]
    assert longer[0]["ended"] == 13 and longer[0]["latency_s"]["p99"] > 90


def test_a_window_with_nothing_recorded_reports_no_deployment(api) -> None:
    record("chat", age_s=1000, now=timezone.now())

    assert api.get("/api/traffic/").json() == {"results": []}


@pytest.mark.parametrize(
    ("query", "field", "said"),
    [
        ("window_s=10", "window_s", "greater than or equal to 60"),
        ("window_s=99999999", "window_s", "records are kept that long (GPUPORTAL_REQUEST_RECORD_RETENTION_S)"),
        ("window_s=nan", "window_s", "A valid number is required."),
        ("windows=600", "windows", "window_s"),
    ],
)
def test_a_bad_window_is_a_400_naming_it(api, query, field, said) -> None:
    response = api.get(f"/api/traffic/?{query}")

    assert response.status_code == 400 and said in str(response.json()[field]), response.json()


def test_an_anonymous_caller_gets_a_401() -> None:
    assert APIClient().get("/api/traffic/").status_code == 401


def test_metrics_show_each_deployments_quantiles_and_tokens_per_second_of_the_last_minutes() -> None:
    now = timezone.now()
    for n in range(1, 5):
        record("chat", age_s=30 * n, wait_s=0.5, run_s=n, tokens=30, first_token_s=0.5 + n / 10, now=now)
    record("chat", age_s=traffic_stats.METRICS_WINDOW_S + 60, run_s=100, now=now)  # older than the window

    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(Client().get("/metrics").content.decode())
        for sample in family.samples
    }

    chat = (("deployment", "chat"),)
    assert samples[("gpuportal_request_latency_seconds", (*chat, ("quantile", "0.5")))] == pytest.approx(3.0)
    assert samples[("gpuportal_request_queue_seconds", (*chat, ("quantile", "0.95")))] == pytest.approx(0.5)
    assert samples[("gpuportal_request_ttft_seconds", (*chat, ("quantile", "0.5")))] == pytest.approx(0.75)
    assert samples[("gpuportal_request_per_output_token_seconds", (*chat, ("quantile", "0.5")))] == pytest.approx(
        2.5 / 30
    )
    assert samples[("gpuportal_output_tokens_per_second", chat)] == pytest.approx(120 / traffic_stats.METRICS_WINDOW_S)


def test_gpuportal_stats_prints_a_row_a_deployment(live_server, capsys) -> None:
    from rest_framework.authtoken.models import Token

    now = timezone.now()
    for n in range(1, 5):
        record("chat", age_s=10 * n, wait_s=0.25, run_s=n, tokens=40, first_token_s=0.5, now=now)
    record("chat", age_s=5, wait_s=None, run_s=0.1, status="failed", tokens=None, now=now)
    record("quiet", age_s=3000, now=now)  # outside the window: no row
    env = {"GPUPORTAL_URL": live_server.url, "GPUPORTAL_TOKEN": Token.objects.create(user=User.objects.create()).key}

    assert app.main(["stats", "--window", "10m"], env=env) == 0

    lines = capsys.readouterr().out.splitlines()
    header = ["DEPLOYMENT", "ENDED", "FAILED", "P50", "P95", "P99", "TTFT95", "WAIT95", "TOK/S", "MS/TOK"]
    assert lines[0].split() == header
    # Latency: 1.25, 2.25, 3.25, 4.25 s; the first token 0.5 s; the wait 0.25 s; 160 tokens in 600 s;
    # 1..4 s over 40 tokens.
    assert lines[1].split() == ["chat", "5", "1", "2.75s", "4.10s", "4.22s", "0.50s", "0.25s", "0.27", "62.5"]
    assert len(lines) == 2

    assert app.main(["stats", "quiet", "--window", "90"], env=env) == 0
    assert capsys.readouterr().out.startswith("no request to quiet ended in the last 90 s")


def test_gpuportal_stats_refuses_a_window_that_is_no_length_of_time(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        app.main(["stats", "--window", "soon"], env={"GPUPORTAL_URL": "http://127.0.0.1:9", "GPUPORTAL_TOKEN": "t"})

    assert exited.value.code == 2
    assert "argument --window: not a length of time: 'soon' (e.g. 300, 10m, 1h, 7d)" in capsys.readouterr().err
