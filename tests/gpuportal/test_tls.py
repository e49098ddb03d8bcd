"""TLS to PostgreSQL and Redis is a setting, the URLs' own (docs/kubernetes.md, "TLS"): every
connection the portal opens from DATABASE_URL or REDIS_URL honours what the URL asks for, verified
against the CA the URL names.

The session's servers speak no TLS, so TLS-terminating proxies (tests/support/tls_proxy.py) stand in
front of them, with certificates of a CA made here. A proxy refuses plain text, so a client that
fell back to it would fail; and it counts the handshakes it completed, so each test also shows that
its traffic went over TLS. A certificate that the URL's CA did not sign, or one issued for another
host, every client must refuse, sending the server nothing. No process is started: each client is
built in this process the way the product builds it from its settings, which a node agent's or a
worker's process reads from the same environment."""

from __future__ import annotations

import contextlib
import ssl
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import pytest
import redis
import trustme
from celery import Celery
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, OperationalError, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend
from kombu.exceptions import OperationalError as BrokerError
from pytest_django import DjangoDbBlocker, Settings

from gpuportal import health, throttle
from gpuportal.celery import app as portal_app
from gpuportal.settings import database_from_url
from gpuportal.wire import node_lease, replies
from gpuportal.wire.requestqueue import RequestQueue
from inference.gateway import RemoteControl
from scheduling.beat_lock import SendsOnlyWhileLocked
from tests.support.tls_proxy import TlsProxy, postgres_proxy, redis_proxy

# What Python's ssl module (under redis-py and kombu) says of a certificate it cannot verify, by
# its signature or by the name it was issued for.
CERTIFICATE_REFUSED = "certificate verify failed"
# And what libpq says, of either.
POSTGRES_CERTIFICATE_REFUSED = "certificate verify failed|does not match host name"


# -- certificates and proxies ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture(scope="module")
def stranger_ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that signed nothing the proxies show."""
    path = tmp_path_factory.mktemp("tls-stranger") / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path


def server_context(ca: trustme.CA, *names: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(context)
    return context


@pytest.fixture(scope="module")
def trusted(ca: trustme.CA) -> ssl.SSLContext:
    # The clients reach the proxies at 127.0.0.1, and verified TLS checks that name too.
    return server_context(ca, "127.0.0.1", "localhost")


@pytest.fixture(params=["signed-by-another-ca", "issued-for-another-host"])
def untrusted(
    request: pytest.FixtureRequest, ca: trustme.CA, ca_file: Path, stranger_ca_file: Path, trusted: ssl.SSLContext
) -> tuple[ssl.SSLContext, Path]:
    """A certificate for a proxy to show that its clients must refuse, and the CA file they are given."""
    if request.param == "signed-by-another-ca":
        return trusted, stranger_ca_file
    return server_context(ca, "db.elsewhere.example"), ca_file


def postgres_upstream() -> tuple[str, int]:
    db = settings.DATABASES[DEFAULT_DB_ALIAS]
    return db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)


def redis_upstream() -> tuple[str, int]:
    parts = urlsplit(settings.REDIS_URL)
    return parts.hostname or "127.0.0.1", parts.port or 6379


@pytest.fixture
def postgres_tls(trusted: ssl.SSLContext) -> Iterator[TlsProxy]:
    with postgres_proxy(postgres_upstream(), trusted) as proxy:
        yield proxy


@pytest.fixture
def redis_tls(trusted: ssl.SSLContext) -> Iterator[TlsProxy]:
    with redis_proxy(redis_upstream(), trusted) as proxy:
        yield proxy


def database_url(proxy: TlsProxy, **query: str | Path) -> str:
    """The session's PostgreSQL behind `proxy`, as an operator's DATABASE_URL names it. Its
    `postgres` database, which always exists (pytest-django creates the test database from it):
    nothing here needs the test database, so the file runs without creating one."""
    db = settings.DATABASES[DEFAULT_DB_ALIAS]
    auth = quote(db["USER"], safe="") + (f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@127.0.0.1:{proxy.port}/postgres?{urlencode(query, safe='/')}"


def rediss_url(proxy: TlsProxy, ca_file: Path) -> str:
    """The session's Redis (this process's database in it) behind `proxy`, as docs/kubernetes.md
    has an operator write REDIS_URL for a private CA."""
    parts = urlsplit(settings.REDIS_URL)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@127.0.0.1:{proxy.port}" if auth else f"127.0.0.1:{proxy.port}"
    query = urlencode({"ssl_cert_reqs": "required", "ssl_ca_certs": str(ca_file)}, safe="/")
    return urlunsplit(("rediss", netloc, parts.path, query, ""))


# -- PostgreSQL ----------------------------------------------------------------------------------


@contextlib.contextmanager
def django_connection(url: str) -> Iterator[BaseDatabaseWrapper]:
    """A Django connection with the settings the portal makes of DATABASE_URL (gpuportal.settings),
    apart from Django's own connections, which the rest of the session keeps using."""
    db = connections.configure_settings({DEFAULT_DB_ALIAS: database_from_url(url)})[DEFAULT_DB_ALIAS]
    wrapper = load_backend(db["ENGINE"]).DatabaseWrapper(db, "tls")
    try:
        yield wrapper
    finally:
        wrapper.close()


def test_the_control_plane_reaches_postgresql_only_over_verified_tls(
    postgres_tls: TlsProxy, ca_file: Path, django_db_blocker: DjangoDbBlocker
) -> None:
    url = database_url(postgres_tls, sslmode="verify-full", sslrootcert=ca_file)

    with django_db_blocker.unblock(), django_connection(url) as connection:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
        assert connection.connection.pgconn.ssl_in_use

    assert (postgres_tls.handshakes, postgres_tls.refused) == (1, 0)


def test_the_control_plane_refuses_a_postgresql_certificate_it_cannot_verify(
    untrusted: tuple[ssl.SSLContext, Path], django_db_blocker: DjangoDbBlocker
) -> None:
    context, ca_file = untrusted
    with postgres_proxy(postgres_upstream(), context) as proxy:
        url = database_url(proxy, sslmode="verify-full", sslrootcert=ca_file)

        with (
            django_db_blocker.unblock(),
            django_connection(url) as connection,
            pytest.raises(OperationalError, match=POSTGRES_CERTIFICATE_REFUSED),
        ):
            connection.ensure_connection()

    assert proxy.forwarded == 0  # no startup, no password: the server heard nothing


def test_the_postgresql_proxy_refuses_a_client_that_speaks_plain_text(
    postgres_tls: TlsProxy, django_db_blocker: DjangoDbBlocker
) -> None:
    # What the tests above rely on: a client that fell back to plain text fails, never passes.
    url = database_url(postgres_tls, sslmode="disable")

    with (
        django_db_blocker.unblock(),
        django_connection(url) as connection,
        pytest.raises(OperationalError, match="refuses plain-text"),
    ):
        connection.ensure_connection()

    assert (postgres_tls.handshakes, postgres_tls.refused) == (0, 1)


# -- Redis: every client the product opens from a URL -------------------------------------------


def request_queue(url: str, settings: Settings) -> None:
    """The request queues (RequestQueue.from_url): the web's submit and a replica's take and answer
    (a replica is given the agent's REDIS_URL, inference.supervisor)."""
    web, replica = RequestQueue.from_url(url), RequestQueue.from_url(url)
    deployment = f"tls-{uuid.uuid4().hex[:8]}"
    try:
        sent = web.submit(deployment, kind="generate", input="hi", params={}, owner="1")
        assert sent is not None
        taken = replica.take(deployment, "tls-replica", timeout=1)
        assert taken is not None and taken.id == sent.id
        replica.finish(taken.id, "tls-replica", {"text": "hello"})
        answered = web.get(sent.id)
        assert answered is not None and answered.status == "done"
    finally:
        web.redis.close()
        replica.redis.close()


def node_lease_of_an_agent(url: str, settings: Settings) -> None:
    """A node agent's lease, renewed on the client the agent uses for it (replies.client)."""
    client = replies.client(url)
    node = f"tls-{uuid.uuid4().hex[:8]}"
    try:
        assert node_lease.renew(client, node, ttl_s=5) == 0
        assert node_lease.held(client, [node]) == {node}
        node_lease.release(client, node)
    finally:
        client.close()
        replies.client.cache_clear()  # no later test is handed this client, its proxy gone


def answers_to_an_agent(url: str, settings: Settings) -> None:
    """Where a node agent waits for the control plane's answers to its calls (RemoteControl)."""
    control = RemoteControl(portal_app, url, node="tls")
    reply_to = replies.new_list(control.replies_kind)
    try:
        replies.answer(control.redis, reply_to, result="registered")
        assert replies.wait(control.redis, reply_to, 5, "a registration") == "registered"
    finally:
        control.redis.close()


def readiness_probe(url: str, settings: Settings) -> None:
    """The web's /readyz (gpuportal.health), which reads settings.REDIS_URL."""
    settings.REDIS_URL = url
    health.check_redis()


def beat_lock(url: str, settings: Settings) -> None:
    """The beat's lock (scheduling.beat_lock), built from settings.REDIS_URL."""
    settings.REDIS_URL = url
    lock = SendsOnlyWhileLocked().make_beat_lock()
    lock.key = f"test:tls:beat-lock:{uuid.uuid4().hex}"  # not the lock a real beat would hold
    try:
        assert lock.hold()
        assert lock.holder_now() == lock.holder
        lock.release()
    finally:
        lock.client.close()


REDIS_CLIENTS: list[Callable[[str, Settings], None]] = [
    request_queue,
    node_lease_of_an_agent,
    answers_to_an_agent,
    readiness_probe,
    beat_lock,
]


@pytest.mark.parametrize("client", REDIS_CLIENTS, ids=lambda client: client.__name__)
def test_every_redis_client_of_the_portal_round_trips_over_verified_tls(
    client: Callable[[str, Settings], None], redis_tls: TlsProxy, ca_file: Path, settings: Settings
) -> None:
    client(rediss_url(redis_tls, ca_file), settings)

    assert redis_tls.handshakes >= 1
    assert redis_tls.refused == 0


@pytest.mark.parametrize("client", REDIS_CLIENTS, ids=lambda client: client.__name__)
def test_every_redis_client_of_the_portal_refuses_a_certificate_it_cannot_verify(
    client: Callable[[str, Settings], None], untrusted: tuple[ssl.SSLContext, Path], settings: Settings
) -> None:
    context, ca_file = untrusted
    with (
        redis_proxy(redis_upstream(), context) as proxy,
        pytest.raises(redis.ConnectionError, match=CERTIFICATE_REFUSED),
    ):
        client(rediss_url(proxy, ca_file), settings)

    assert proxy.forwarded == 0


def test_the_redis_proxy_refuses_a_client_that_speaks_plain_text(redis_tls: TlsProxy) -> None:
    # What the tests above rely on, as for PostgreSQL.
    client = redis.Redis.from_url(f"redis://127.0.0.1:{redis_tls.port}/0", socket_timeout=5)
    try:
        with pytest.raises(redis.RedisError):
            client.ping()
    finally:
        client.close()

    assert redis_tls.handshakes == 0
    assert redis_tls.refused >= 1


@pytest.fixture
def throttle_on(redis_tls: TlsProxy, settings: Settings) -> Iterator[Callable[[Path], None]]:
    """Points the sign-in throttle (gpuportal.throttle, which keeps one client per process) at the
    proxy with the given CA, and afterwards back at the session's Redis."""

    def point(ca_file: Path) -> None:
        settings.REDIS_URL = rediss_url(redis_tls, ca_file)
        settings.GPUPORTAL_AUTH_FAILURES_PER_MINUTE = 1
        throttle._client.cache_clear()

    yield point
    throttle._client().close()
    throttle._client.cache_clear()


def test_the_sign_in_throttle_counts_failures_over_verified_tls(
    throttle_on: Callable[[Path], None], redis_tls: TlsProxy, ca_file: Path
) -> None:
    throttle_on(ca_file)
    names = throttle.keys(None, f"tls-{uuid.uuid4().hex[:8]}")

    throttle.failed(names)

    assert throttle.wait_s(names) is not None
    assert redis_tls.handshakes >= 1


def test_the_sign_in_throttle_refuses_a_redis_whose_certificate_another_ca_signed(
    throttle_on: Callable[[Path], None], redis_tls: TlsProxy, stranger_ca_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    throttle_on(stranger_ca_file)
    names = throttle.keys(None, f"tls-{uuid.uuid4().hex[:8]}")

    # The throttle lets sign-ins through when Redis is unreachable, and says why.
    throttle.failed(names)

    assert CERTIFICATE_REFUSED in caplog.text
    assert throttle.wait_s(names) is None
    assert redis_tls.forwarded == 0


# -- Celery's broker and result backend --------------------------------------------------------


def celery_app(url: str, settings: Settings) -> Celery:
    """A Celery app configured as gpuportal.celery configures the portal's, with REDIS_URL = `url`
    (gpuportal.settings makes it the broker and the result backend)."""
    settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = url
    # Not made the current app: the portal's shared tasks, in later tests, stay with the portal's.
    app = Celery("gpuportal", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    return app


def test_celery_sends_takes_and_keeps_results_over_verified_tls(
    redis_tls: TlsProxy, ca_file: Path, settings: Settings
) -> None:
    app = celery_app(rediss_url(redis_tls, ca_file), settings)
    queue_name = f"tls-check-{uuid.uuid4().hex[:8]}"
    try:
        with app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=0)
            with connection.SimpleQueue(queue_name) as queue:
                sent = app.send_task("gpuportal.tls_check", args=[42], queue=queue_name)
                message = queue.get(timeout=10)
                message.ack()
                queue.queue.delete()
        assert (message.headers["task"], message.headers["id"]) == ("gpuportal.tls_check", sent.id)

        app.backend.store_result(sent.id, 42, "SUCCESS")
        assert app.backend.get_task_meta(sent.id)["result"] == 42
        app.backend.forget(sent.id)
    finally:
        app.close()

    assert redis_tls.handshakes >= 2  # the broker's connection and the result backend's at least
    assert redis_tls.refused == 0


def test_celery_refuses_a_broker_whose_certificate_another_ca_signed(
    redis_tls: TlsProxy, stranger_ca_file: Path, settings: Settings
) -> None:
    app = celery_app(rediss_url(redis_tls, stranger_ca_file), settings)
    try:
        with app.connection_for_write() as connection, pytest.raises(BrokerError, match=CERTIFICATE_REFUSED):
            connection.ensure_connection(max_retries=0)
        with pytest.raises(redis.ConnectionError, match=CERTIFICATE_REFUSED):
            app.backend.client.ping()
    finally:
        app.close()

    assert redis_tls.forwarded == 0
