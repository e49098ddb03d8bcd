"""Each node's agent shows a credential of its own with every call, and the control plane applies
a call only when the token is the one issued to the node it speaks for: a wrong, absent or other
node's token is refused and nothing is applied; revoking a credential writes its node off at once.
The calls go through the control plane's side of the wire (node_gateway.answer) as the `agents`
worker receives them, in this process; the last test runs three real agents without a database."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import OperationalError
from rest_framework.test import APIClient

from gpuportal.wire import node_acl, node_auth, node_lease, replies
from gpuportal.wire.control import Call, encode_call
from gpuportal.wire.node_lease import NodeFence
from gpuportal.wire.node_reports import DeviceInfo
from gpuportal.wire.requestqueue import RequestQueue, records_key, stops_key
from scheduling.models import Event, Node, NodeCredential, Replica
from scheduling.services import node_credentials, node_gateway, queue_grants
from scheduling.services.errors import InvalidInput, InvalidState, NotFound
from tests.support import factories
from tests.support.processes import wait_until

GIB = 1024**3
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def required(settings, db, dispatched, monkeypatch):
    """Credentials `required`, as a portal runs by default; nothing sent to a worker. The gateway's
    calls run inside the test's transaction: its worker's way of dropping a dead connection first
    would end that transaction."""
    settings.GPUPORTAL_NODE_AUTH = "required"
    monkeypatch.setattr(node_gateway, "close_old_connections", lambda: None)


def call(name: str, *args, token: str | None = None, **kwargs) -> tuple[str, object]:
    """One agent's call as the `agents` worker gets it: what the gateway did ("refused", or the
    call's name) and the answer's error, or its result."""
    reply_to = replies.new_list("test")
    outcome = node_gateway.answer(encode_call(Call(name, reply_to, args, kwargs, token=token)))
    try:
        return outcome, replies.wait(replies.client(settings.REDIS_URL), reply_to, 2, name)
    except replies.NoAnswer as err:
        return outcome, str(err)


def register(node: str, token: str | None) -> tuple[str, object]:
    gpu = DeviceInfo(index=0, uuid=f"GPU-{node}-0", product="Virtual GPU", total_bytes=4 * GIB, virtual=True)
    return call("register_node", node, [gpu], token=token, hostname="h", cpu_cache_bytes=GIB, virtual=True)


def test_an_issued_token_is_shown_once_and_only_its_hash_is_kept(required):
    token = node_credentials.issue("gpu-1", "ops")

    row = NodeCredential.objects.get(node="gpu-1")
    assert token.startswith(node_auth.TOKEN_PREFIX) and token not in str(row.__dict__)
    assert row.token_hash == node_auth.token_hash(token) and row.created_by == "ops" and row.revoked_at is None
    assert Event.objects.filter(kind=Event.Kind.NODE_CREDENTIAL, node="gpu-1").exists()
    assert node_credentials.verify("gpu-1", token) is None


def test_a_node_with_its_token_registers_and_beats(required):
    token = node_credentials.issue("gpu-1", "ops")

    epoch = node_lease.current_epoch(replies.client(settings.REDIS_URL), "gpu-1")
    assert register("gpu-1", token) == ("register_node", epoch), "answered with the epoch it starts replicas under"
    assert call("heartbeat", "gpu-1", token=token, books=None, running=[]) == ("heartbeat", [])
    assert Node.objects.get(name="gpu-1").status == Node.Status.ONLINE
    assert NodeCredential.objects.get(node="gpu-1").last_used_at is not None


def test_a_registration_whose_credential_check_meets_a_database_starting_up_waits_for_it(required, monkeypatch):
    # `up` starts a killed agent again while PostgreSQL restarts: the check must wait for the
    # database as the registration behind it does, not answer the agent with an error.
    token = node_credentials.issue("gpu-1", "ops")
    verify, refused = node_credentials.verify, []

    def starting_up(node, sent):
        if not refused:
            refused.append(node)
            raise OperationalError("FATAL:  the database system is starting up")
        return verify(node, sent)

    monkeypatch.setattr(node_credentials, "verify", starting_up)
    # Between tries the gateway drops its dead connection; here that would end the test's transaction.
    monkeypatch.setattr(node_gateway, "connection", SimpleNamespace(close=lambda: None))

    assert register("gpu-1", token)[0] == "register_node" and refused == ["gpu-1"]
    assert Node.objects.get(name="gpu-1").status == Node.Status.ONLINE


@pytest.mark.parametrize(
    ("issued", "sent", "why"),
    [
        (False, None, "node gpu-1 has no credential (GPUPORTAL_NODE_AUTH is required)"),
        (True, None, "node gpu-1 has a credential, and the call carries no token"),
        (True, "gpn_not-it", "the call's token is not node gpu-1's credential"),
    ],
)
def test_it_refuses_a_call_with_an_absent_or_wrong_token_and_applies_nothing(required, issued, sent, why):
    if issued:
        node_credentials.issue("gpu-1", "ops")

    outcome, error = register("gpu-1", sent)

    assert outcome == "refused"
    assert node_auth.is_refusal(error) and why in error, error
    assert not Node.objects.filter(name="gpu-1").exists()


def test_a_token_of_one_node_cannot_speak_for_another_or_for_its_replicas(required):
    mine, theirs = node_credentials.issue("a", "ops"), node_credentials.issue("b", "ops")
    register("a", mine)
    register("b", theirs)
    replica = factories.replica(factories.deployment("d"), on=Node.objects.get(name="b"), state=Replica.State.PENDING)

    assert call("heartbeat", "b", token=mine, books=None, running=[])[0] == "refused"
    outcome, error = call("report", replica.id, {"event": "progress", "percent": 40}, token=mine)
    assert outcome == "refused" and "not node b's credential" in error
    assert call("replica_state", replica.id, token=mine)[0] == "refused"
    replica.refresh_from_db()
    assert (replica.state, replica.progress) == (Replica.State.PENDING, None), "the refused report was not applied"
    # Its own node's token reports for it; a replica the books no longer know needs some node's.
    assert call("report", replica.id, {"event": "progress", "percent": 40}, token=theirs) == ("report", None)
    assert call("replica_state", "gone", token=mine) == ("replica_state", None)
    assert call("replica_state", "gone", token=None)[0] == "refused"


def test_revoking_writes_the_node_off_with_its_replicas_and_refuses_it_from_then_on(
    required, django_capture_on_commit_callbacks
):
    token = node_credentials.issue("gpu-1", "ops")
    register("gpu-1", token)
    node = Node.objects.get(name="gpu-1")
    replica = factories.replica(factories.deployment("d"), on=node, state=Replica.State.SERVING)
    node_lease.renew(replies.client(settings.REDIS_URL), "gpu-1", 30)

    with django_capture_on_commit_callbacks(execute=True):
        node_credentials.revoke("gpu-1", "ops", "host decommissioned")

    assert Node.objects.get(name="gpu-1").status == Node.Status.OFFLINE
    replica.refresh_from_db()
    assert replica.state in (Replica.State.STOPPED, Replica.State.FAILED), "lost with its node"
    revoked = Event.objects.get(kind=Event.Kind.NODE_REVOKED, node="gpu-1")
    assert "credential revoked by ops: host decommissioned" in revoked.reason
    assert Event.objects.filter(kind=Event.Kind.NODE_OFFLINE, node="gpu-1").exists()
    assert node_lease.held(replies.client(settings.REDIS_URL), ["gpu-1"]) == set(), "its lease is no evidence now"
    outcome, error = call("heartbeat", "gpu-1", token=token, books=None, running=[])
    assert outcome == "refused" and "node gpu-1's credential was revoked" in error
    assert Node.objects.get(name="gpu-1").status == Node.Status.OFFLINE, "a refused beat brings nothing back"
    with pytest.raises(InvalidState, match="revoked already"):
        node_credentials.revoke("gpu-1", "ops")


def test_revoking_deletes_the_nodes_own_redis_user_and_closes_its_connections(
    required, django_capture_on_commit_callbacks
):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    node_credentials.issue("gpu-7", "ops")
    admin = replies.client(settings.REDIS_URL)
    user = node_acl.user_name("gpu-7")
    # Rules any Redis 6 takes: what matters here is that the user exists and is connected.
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw-of-gpu-7", "~gp:*", "&*", "+@all")
    try:
        kwargs = admin.connection_pool.connection_kwargs
        node_side = redis.Redis(
            host=kwargs.get("host", "127.0.0.1"),
            port=kwargs.get("port", 6379),
            db=kwargs.get("db", 0),
            username=user,
            password="pw-of-gpu-7",
            # Once refused, refused: redis-py's default tries a refused password again for seconds.
            retry=Retry(NoBackoff(), 0),
        )
        # What a revoked node would do: lower the epoch it is about to be fenced by.
        assert node_side.set(node_lease.epoch_key("gpu-7"), 0)

        with django_capture_on_commit_callbacks(execute=True):
            node_credentials.revoke("gpu-7", "ops")

        assert admin.execute_command("ACL", "GETUSER", user) is None
        with pytest.raises(redis.RedisError):
            node_side.set(node_lease.epoch_key("gpu-7"), 0)
        assert node_lease.current_epoch(admin, "gpu-7") >= 1, "fenced, and the node cannot undo it"
        assert "its own Redis user (if it has one) deleted" in Event.objects.get(kind=Event.Kind.NODE_REVOKED).reason
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.delete(node_lease.epoch_key("gpu-7"), node_lease.lease_key("gpu-7"))
    # A node given no user of its own is revoked all the same.
    node_credentials.issue("gpu-8", "ops")
    with django_capture_on_commit_callbacks(execute=True):
        node_credentials.revoke("gpu-8", "ops")
    assert NodeCredential.objects.get(node="gpu-8").revoked_at is not None


def test_a_node_is_written_off_again_when_its_revocation_commits_while_its_beat_is_applied(required, monkeypatch):
    token = node_credentials.issue("gpu-1", "ops")
    register("gpu-1", token)
    node_credentials.revoke("gpu-1", "ops")
    # The beat passed its check before the revocation committed, and is applied after it.
    monkeypatch.setattr(node_credentials, "check_call", lambda *args: None)

    call("heartbeat", "gpu-1", token=token, books=None, running=[])

    assert Node.objects.get(name="gpu-1").status == Node.Status.OFFLINE


def test_issuing_anew_refuses_the_old_token_and_gives_a_revoked_node_a_credential_again(required):
    old = node_credentials.issue("gpu-1", "ops")
    new = node_credentials.issue("gpu-1", "ops")

    assert node_credentials.verify("gpu-1", old) is not None and node_credentials.verify("gpu-1", new) is None
    node_credentials.revoke("gpu-1", "ops")
    again = node_credentials.issue("gpu-1", "ops")
    assert node_credentials.verify("gpu-1", again) is None and node_credentials.verify("gpu-1", new) is not None


def test_open_lets_a_node_without_a_credential_call_but_not_one_that_has_one_or_was_revoked(required, settings):
    settings.GPUPORTAL_NODE_AUTH = "open"
    assert register("free", None)[0] == "register_node"

    node_credentials.issue("issued", "ops")
    assert register("issued", None)[0] == "refused"
    node_credentials.revoke("issued", "ops")
    assert register("issued", None)[0] == "refused"


def test_a_refused_call_from_a_node_with_live_replicas_is_an_event_once_a_minute(required):
    token = node_credentials.issue("gpu-1", "ops")
    register("gpu-1", token)
    factories.replica(factories.deployment("d"), on=Node.objects.get(name="gpu-1"), state=Replica.State.SERVING)

    for _ in range(3):
        assert call("heartbeat", "gpu-1", token="gpn_stale", books=None, running=[])[0] == "refused"

    (refused,) = Event.objects.filter(kind=Event.Kind.NODE_REFUSED, node="gpu-1")
    assert "not node gpu-1's credential" in refused.reason and refused.after == {"replicas": 1}


def test_a_bad_name_or_a_missing_credential_is_refused_naming_it(required):
    with pytest.raises(InvalidInput, match="'bad name!' is not a valid node name"):
        node_credentials.issue("bad name!", "ops")
    with pytest.raises(NotFound, match="node nobody has no credential"):
        node_credentials.revoke("nobody", "ops")
    assert not NodeCredential.objects.exists()


# A node as Kubernetes names it on EKS (its DaemonSet passes spec.nodeName as --node).
EKS_NODE = "ip-10-0-1-2.ec2.internal"


def test_a_node_named_as_a_cloud_names_its_hosts_registers_beats_and_is_read_by_the_api(required, admin_api):
    token = node_credentials.issue(EKS_NODE, "ops")

    assert register(EKS_NODE, token)[0] == "register_node"
    assert call("heartbeat", EKS_NODE, token=token, books=None, running=[]) == ("heartbeat", [])
    read = admin_api.get(f"/api/nodes/{EKS_NODE}/")
    assert read.status_code == 200 and read.data["name"] == EKS_NODE and read.data["status"] == "online"
    assert f"~node.{EKS_NODE}" in node_acl.rules(EKS_NODE), "its Redis user reaches its own queue"
    revoked = admin_api.delete(f"/api/nodes/{EKS_NODE}/credential/")
    assert revoked.status_code == 200, revoked.data


@pytest.mark.parametrize("name", [".hidden", "a b", "a/b", "a:b", "gpu*", "x" * 101, ""])
def test_a_name_no_host_has_is_refused_everywhere_a_node_is_named(required, name):
    with pytest.raises(InvalidInput, match=re.escape(f"is not a valid node name: {node_auth.NODE_NAME_RULE}")):
        node_credentials.issue(name, "ops")
    with pytest.raises(ValueError, match="is not a valid node name"):
        node_acl.rules(name)


# -- the agent's side --------------------------------------------------------------------------


def test_the_agent_reads_its_token_from_the_environment_or_the_file_named_there(tmp_path):
    path = tmp_path / "token"
    path.write_text("gpn_from-file\n")

    assert node_auth.read_token({node_auth.TOKEN_ENV: "gpn_direct"}) == "gpn_direct"
    assert node_auth.read_token({node_auth.TOKEN_FILE_ENV: str(path)}) == "gpn_from-file"
    assert node_auth.read_token({}) is None
    with pytest.raises(node_auth.TokenError, match="missing: No such file"):
        node_auth.read_token({node_auth.TOKEN_FILE_ENV: str(tmp_path / "missing")})


@pytest.mark.parametrize(("mode", "warned"), [(0o600, False), (0o440, False), (0o644, True)])
def test_the_agent_warns_of_a_token_file_every_user_of_its_host_may_read(tmp_path, caplog, mode, warned):
    path = tmp_path / "token"
    path.write_text("gpn_from-file\n")
    path.chmod(mode)

    with caplog.at_level(logging.WARNING, logger="gpuportal.wire.node_auth"):
        assert node_auth.read_token({node_auth.TOKEN_FILE_ENV: str(path)}) == "gpn_from-file"

    said = [r.getMessage() for r in caplog.records]
    assert bool(said) is warned, said
    if warned:
        assert said == [
            f"{node_auth.TOKEN_FILE_ENV}={path} is readable by every user of this host (mode 0644): "
            "whoever reads it can speak for the node; `chmod 600` it (or 640, for a group of its own)"
        ]


def test_the_command_issues_into_a_private_file_and_keeps_a_token_still_valid(required, tmp_path, capsys):
    path = tmp_path / "tokens" / "local"

    call_command("node_credential", "issue", "local", "--token-file", str(path), "--keep")
    token = path.read_text().strip()
    assert path.stat().st_mode & 0o777 == 0o600 and node_credentials.holds("local", token)
    call_command("node_credential", "issue", "local", "--token-file", str(path), "--keep")
    assert path.read_text().strip() == token and "still valid: kept" in capsys.readouterr().out

    call_command("node_credential", "revoke", "local", "--reason", "moved")
    call_command("node_credential", "issue", "local", "--token-file", str(path), "--keep")
    assert path.read_text().strip() != token and node_credentials.holds("local", path.read_text().strip())


# -- the API -----------------------------------------------------------------------------------


@pytest.fixture
def admin_api(required) -> APIClient:
    client = APIClient()
    client.force_authenticate(User.objects.create_user("ops", is_staff=True))
    return client


def test_the_api_issues_a_token_once_and_revokes_it(admin_api):
    issued = admin_api.post("/api/nodes/gpu-7/credential/")
    assert issued.status_code == 201, issued.data
    assert issued.data["node"] == "gpu-7" and node_credentials.holds("gpu-7", issued.data["token"])

    revoked = admin_api.delete("/api/nodes/gpu-7/credential/?reason=stolen")
    assert revoked.status_code == 200, revoked.data
    assert revoked.data["revoked_at"] and "token" not in revoked.data
    assert "stolen" in Event.objects.get(kind=Event.Kind.NODE_REVOKED, node="gpu-7").reason
    again = admin_api.delete("/api/nodes/gpu-7/credential/")
    assert again.status_code == 409 and "revoked already" in again.data["detail"]


def test_the_api_answers_404_400_and_403_naming_what_is_wrong(admin_api):
    missing = admin_api.delete("/api/nodes/nobody/credential/")
    assert missing.status_code == 404 and missing.data == {"detail": "node nobody has no credential"}
    bad = admin_api.post("/api/nodes/bad%20name!/credential/")
    assert bad.status_code == 400 and "'bad name!' is not a valid node name" in bad.data["node"][0]

    user = APIClient()
    user.force_authenticate(User.objects.create_user("alice"))
    assert user.post("/api/nodes/gpu-7/credential/").status_code == 403
    assert user.delete("/api/nodes/gpu-7/credential/").status_code == 403
    assert not NodeCredential.objects.exists()


# -- three agents on loopback ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_three_agents_without_a_database_url_and_revoking_one_fences_it_within_a_lease(tmp_path, agents_worker):
    """A control host (the test's `agents` worker) and three node agents, each with its own data
    directory and token, none told where the database is: they register and beat through Redis
    alone. Revoking one writes it off at once; its agent hears the refusal at its next beat and
    stops, exit code 1 naming why, within one lease; the others serve on. A node with a Redis
    user of its own (n3) hears it from Redis, which no longer knows its user, and stops the same."""
    import redis

    names = ("n1", "n2", "n3")
    base = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "GPUPORTAL_DATA_DIR"}}
    admin = redis.Redis.from_url(settings.REDIS_URL)
    # Rules any Redis 6 takes (the node's own need 7): what matters is that its user exists.
    own_user = node_acl.user_name("n3")
    admin.execute_command("ACL", "SETUSER", own_user, "reset", "on", ">pw-of-n3", "~*", "&*", "+@all")
    server = admin.connection_pool.connection_kwargs
    own_url = f"redis://{own_user}:pw-of-n3@{server['host']}:{server['port']}/{server['db']}"
    agents = {}
    for name in names:
        data_dir = tmp_path / name
        data_dir.mkdir()
        token_file = data_dir / "token"
        token_file.write_text(node_credentials.issue(name, "test"))
        env = {
            **base,
            "REDIS_URL": own_url if name == "n3" else settings.REDIS_URL,
            "GPUPORTAL_DATA_DIR": str(data_dir),
            "GPUPORTAL_HEARTBEAT_S": "1",
            node_auth.TOKEN_FILE_ENV: str(token_file),
        }
        with open(data_dir / "agent.log", "w") as log:  # the child keeps its own copy of the descriptor
            agents[name] = subprocess.Popen(
                [sys.executable, "manage.py", "agent", "--node", name, "--virtual-gpus", "1x2GiB"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log_of(name: str) -> str:
        return (tmp_path / name / "agent.log").read_text()

    try:
        wait_until(
            lambda: (
                Node.objects.filter(name__in=names, status="online").count() == 3
                or any(p.poll() is not None for p in agents.values())
            ),
            60,
            "three agents",
        )
        assert all(p.poll() is None for p in agents.values()), {n: log_of(n)[-2000:] for n in names}
        beats = dict(Node.objects.filter(name__in=names).values_list("name", "last_heartbeat"))
        wait_until(lambda: all(Node.objects.get(name=n).last_heartbeat > beats[n] for n in names), 30, "a beat of each")

        node_credentials.revoke("n2", "test", "compromised")

        assert Node.objects.get(name="n2").status == Node.Status.OFFLINE
        lease_s = node_lease.ttl_s(1, settings.GPUPORTAL_HEARTBEAT_TIMEOUT_S, settings.GPUPORTAL_CONTROL_STALL_S)
        code = agents["n2"].wait(lease_s + 30)  # its stop after the refusal takes a moment of its own
        assert code == 1, log_of("n2")[-3000:]
        assert "CommandError: node n2: heartbeat: node credential refused: node n2's credential was revoked" in log_of(
            "n2"
        )
        assert not node_lease.held(replies.client(settings.REDIS_URL), ["n2"])
        assert Node.objects.get(name="n2").status == Node.Status.OFFLINE
        assert all(agents[n].poll() is None for n in ("n1", "n3"))
        assert set(Node.objects.filter(status="online").values_list("name", flat=True)) == {"n1", "n3"}

        node_credentials.revoke("n3", "test", "compromised")

        assert admin.execute_command("ACL", "GETUSER", own_user) is None, "its user deleted with its credential"
        code = agents["n3"].wait(lease_s + 30)
        assert code == 1, log_of("n3")[-3000:]
        said = r"CommandError: node n3: Redis refused the node's user: .*`manage.py node_credential acl n3 --apply`"
        assert re.search(said, log_of("n3")), log_of("n3")[-3000:]
        assert agents["n1"].poll() is None
        assert set(Node.objects.filter(status="online").values_list("name", flat=True)) == {"n1"}
        # Any use of a database on an agent raises, naming this (gpuportal.no_database).
        assert not any("has no database" in log_of(n) for n in names), "nothing on an agent reached for one"
    finally:
        for process in agents.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        admin.execute_command("ACL", "DELUSER", own_user)


# -- the node's Redis user ---------------------------------------------------------------------


def redis_version(client) -> tuple[int, int]:
    """The server's (major, minor): the node's rules need node_acl.MIN_REDIS."""
    major, minor = client.info("server")["redis_version"].split(".")[:2]
    return int(major), int(minor)


def test_a_nodes_redis_user_consumes_its_own_queue_alone_and_keeps_its_own_unacknowledged_messages():
    rules = node_acl.rules("gpu-3")
    key_rules = [rule for rule in rules if "~" in rule]

    assert [rule for rule in key_rules if "node." in rule and "unacked" not in rule] == [
        "~node.gpu-3",
        f"~node.gpu-3{node_acl._QUEUE_SUFFIX}",
        "~_kombu.binding.node.gpu-3",
        "~_kombu.binding_permanent.node.gpu-3",
    ]
    assert sorted(rule for rule in key_rules if "unacked" in rule) == sorted(
        f"~{key}" for key in node_acl.unacked_keys("gpu-3").values()
    )
    assert all(key.endswith(".node.gpu-3") for key in node_acl.unacked_keys("gpu-3").values())
    assert not any("inspect" in rule or "pidbox" in rule for rule in key_rules), "no queue another node writes to"
    assert [rule for rule in key_rules if "gp:records" in rule] == ["~gp:records:node:gpu-3"], "its own records"


def test_a_nodes_redis_user_reaches_its_own_keys_and_the_shared_ones_but_not_another_nodes():
    import uuid

    import redis

    from gpuportal.wire import node_acl

    admin = redis.Redis.from_url(settings.REDIS_URL)
    node, password = f"acl-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = node_acl.setuser_line(node, password).split()[3:]
    version = redis_version(admin)
    if version < node_acl.MIN_REDIS:
        # An external Redis 6 (REDIS_URL): the rules need 7's read-only and write-only key
        # patterns, and such a server refuses them whole rather than granting more.
        with pytest.raises(redis.ResponseError, match=r"%W~|%R~"):
            admin.execute_command("ACL", "SETUSER", node_acl.user_name(node), *rules)
        assert node_acl.user_name(node) not in admin.acl_users()
        return
    admin.execute_command("ACL", "SETUSER", node_acl.user_name(node), *rules)
    own_unacked = node_acl.unacked_keys(node)
    try:
        kwargs = admin.connection_pool.connection_kwargs
        user = redis.Redis(
            host=kwargs["host"],
            port=kwargs["port"],
            db=kwargs["db"],
            username=node_acl.user_name(node),
            password=password,
        )
        node_lease.renew(user, node, 5)
        user.lpush(f"node.{node}", "a command")
        user.hset(own_unacked["unacked_key"], "a tag", "a command it took")
        user.zadd(own_unacked["unacked_index_key"], {"a tag": 0})
        user.lpush("agents", "a call")
        user.lpush(f"gp:reply:agent:{node}:1", "an answer")
        assert user.blpop([f"gp:reply:agent:{node}:1"], timeout=1) is not None
        user.rpush("gp:reply:inspect:1", "an answer to a question")
        user.set("gp:kv:some-replica", "{}")
        # The asks to stop what a replica holds, read and cleared in one transaction (MULTI).
        admin.hset(stops_key("some-replica"), "a-request", "its caller left")
        assert RequestQueue(user).asked_stops("some-replica") == {"a-request": "its caller left"}
        user.rpush(records_key(node), "a record of its own")
        for refused in (
            lambda: node_lease.renew(user, "another-node", 5),
            lambda: user.lpush("node.another-node", "a command"),
            lambda: user.lpush(f"node.{node}2", "a longer name's command"),
            # What the control plane's workers put back on the queue it names, whichever.
            lambda: user.hset("unacked", "a tag", '[{}, "", "control"]'),
            lambda: user.zadd("unacked_index", {"a tag": 0}),
            lambda: user.hset(node_acl.unacked_keys("another-node")["unacked_key"], "a tag", "x"),
            lambda: user.lpush("inspect", "a question for every node"),
            lambda: user.lpush("control", "a task"),
            lambda: user.lrange("agents", 0, -1),
            lambda: user.blpop(["gp:reply:agent:another-node:1"], timeout=1),
            lambda: user.get("gp:idem:alice:0"),
            # The indexes of requests by owner (every request's id) and the owners' limits.
            lambda: user.zrange("gp:requests:all", 0, -1),
            lambda: user.zrange("gp:requests:owner:alice", 0, -1),
            lambda: user.zcard("gp:user:alice:in_flight"),
            # The records of the requests others end (each names its request's id).
            lambda: user.lrange(records_key(), 0, -1),
            lambda: user.lrange(records_key("another-node"), 0, -1),
            lambda: user.keys("*"),
            lambda: user.flushall(),
            lambda: user.config_get("*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()
    finally:
        admin.execute_command("ACL", "DELUSER", node_acl.user_name(node))
        admin.delete(node_lease.lease_key(node), f"node.{node}", "gp:reply:inspect:1", "gp:kv:some-replica")
        admin.delete(*own_unacked.values(), records_key(node))
        admin.lrem("agents", 0, "a call")  # not a call: the agents worker would only drop it


@pytest.fixture
def fenced_node():
    """A node of the test's own holding its lease under epoch 0, and its keys dropped after."""
    import uuid

    admin = replies.client(settings.REDIS_URL)
    node = f"rec-{uuid.uuid4().hex[:8]}"
    node_lease.renew(admin, node, 30, epoch=0)
    yield node, NodeFence(node, 0)
    admin.delete(node_lease.lease_key(node), node_lease.epoch_key(node), records_key(node))


def ended_by_a_replica(web: RequestQueue, replica_side: RequestQueue, fence: NodeFence) -> str:
    """A request accepted by the web, taken and answered by a replica of the fenced node."""
    import uuid

    deployment = f"d-{uuid.uuid4().hex[:8]}"
    request = web.submit(deployment, kind="generate", input="hi", params={}, owner="alice")
    replica = f"r-{uuid.uuid4().hex[:8]}"
    taken = replica_side.take(deployment, replica, timeout=0, node=fence)
    assert taken is not None and taken.id == request.id
    replica_side.finish(request.id, replica, {"text": "hello"}, node=fence)
    return request.id


@pytest.mark.django_db
def test_a_nodes_replicas_record_what_they_end_in_the_nodes_own_list_which_the_control_plane_drains(
    fenced_node,
):
    from scheduling.models import RequestRecord
    from scheduling.services import traffic

    node, fence = fenced_node
    factories.node(node)
    web = RequestQueue(replies.client(settings.REDIS_URL))
    traffic.drain()  # what earlier tests left in the shared list
    request_id = ended_by_a_replica(web, web, fence)

    assert [r["id"] for r in web.records(10, records_key(node))] == [request_id]
    assert request_id not in [r["id"] for r in web.records(10_000)], "not in the web's list"
    assert traffic.drain() == 1
    assert RequestRecord.objects.filter(request_id=request_id).exists()
    assert web.record_counts([records_key(node)]) == {records_key(node): 0}


def test_a_replica_under_an_earlier_releases_node_user_records_in_the_shared_list_and_says_so(fenced_node, caplog):
    import redis

    node, fence = fenced_node
    admin = replies.client(settings.REDIS_URL)
    if redis_version(admin) < node_acl.MIN_REDIS:
        pytest.skip("the node's rules need Redis 7: REDIS_URL names a Redis 6")
    # The rules of the release before: the shared records, not the node's own.
    earlier = [rule.replace(records_key(node), records_key()) for rule in node_acl.rules(node)]
    admin.execute_command("ACL", "SETUSER", node_acl.user_name(node), *earlier[:2], ">pw", *earlier[2:])
    try:
        kwargs = admin.connection_pool.connection_kwargs
        user = redis.Redis(
            host=kwargs["host"], port=kwargs["port"], db=kwargs["db"], username=node_acl.user_name(node), password="pw"
        )
        web, replica_side = RequestQueue(admin), RequestQueue(user)
        first = ended_by_a_replica(web, replica_side, fence)
        second = ended_by_a_replica(web, replica_side, fence)

        shared = [r["id"] for r in web.records(100_000)]
        assert first in shared and second in shared, "both recorded, where its user may write"
        assert web.record_counts([records_key(node)]) == {records_key(node): 0}
        warned = [r.getMessage() for r in caplog.records if "may not write" in r.getMessage()]
        assert warned == [
            f"node {node}'s Redis user may not write {records_key(node)}: its requests' records go to gp:records, "
            f"which every node's user may read; load the user anew (manage.py node_credential acl {node} --apply)"
        ], "said once, then kept to"
    finally:
        admin.execute_command("ACL", "DELUSER", node_acl.user_name(node))


def test_a_nodes_url_signs_in_as_its_user_on_the_control_planes_server_database_and_options():
    assert (
        node_acl.node_url("redis://:cp-secret@10.0.0.5:6380/3", "gpu-1", "pw")
        == "redis://node-gpu-1:pw@10.0.0.5:6380/3"
    )
    tls = "rediss://cp:s@redis.internal:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
    assert node_acl.node_url(tls, "gpu-1", "a/b@c:d") == (
        "rediss://node-gpu-1:a%2Fb%40c%3Ad@redis.internal:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
    )
    assert node_acl.node_url("redis://[::1]:6379/0", "n", "pw") == "redis://node-n:pw@[::1]:6379/0"
    assert node_acl.node_url("redis://localhost", "n", "pw") == "redis://node-n:pw@localhost"


def test_the_command_makes_the_nodes_redis_user_and_prints_the_url_its_agent_signs_in_with(required, capsys):
    import redis

    admin = replies.client(settings.REDIS_URL)
    node = "acl-made"
    if redis_version(admin) < node_acl.MIN_REDIS:
        with pytest.raises(CommandError, match=r"Redis refused the node's rules .*need Redis 7\.0 or later, or Valkey"):
            call_command("node_credential", "acl", node, "--apply")
        assert node_acl.user_name(node) not in admin.acl_users()
        return
    try:
        call_command("node_credential", "acl", node, "--apply", "--password", "first-pw", "--by", "ops")
        url = capsys.readouterr().out.strip()
        assert url.startswith("redis://node-acl-made:first-pw@") and url.endswith(
            f"/{admin.connection_pool.connection_kwargs['db']}"
        )
        first = redis.Redis.from_url(url)
        node_lease.renew(first, node, 5)
        with pytest.raises(redis.exceptions.NoPermissionError):
            first.lpush("control", "a task")
        made = Event.objects.get(kind=Event.Kind.NODE_CREDENTIAL, node=node)
        assert made.reason == (
            "its own Redis user node-acl-made made by ops (its previous password, if it had one, no longer signs in), "
            "reaching the queues of the deployments placed on it alone"
        )

        # Made again (a node issued its credential anew): the new password alone signs in.
        call_command("node_credential", "acl", node, "--apply")
        second = capsys.readouterr().out.strip()
        assert second != url
        redis.Redis.from_url(second).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()
    finally:
        admin.execute_command("ACL", "DELUSER", node_acl.user_name(node))
        admin.delete(node_lease.lease_key(node), queue_grants.until_key(node))


def test_making_a_nodes_redis_user_is_refused_naming_why_and_makes_nothing(required, settings):
    admin = replies.client(settings.REDIS_URL)
    with pytest.raises(CommandError, match="is not a valid node name"):
        call_command("node_credential", "acl", "bad/name", "--apply")
    with pytest.raises(CommandError, match="the password must be a non-empty word"):
        call_command("node_credential", "acl", "n1", "--apply", "--password", "two words")
    # A control plane whose own Redis user may not administer the server.
    admin.execute_command("ACL", "SETUSER", "cp-limited", "reset", "on", ">cp-pw", "~*", "&*", "+@all", "-@admin")
    kwargs = admin.connection_pool.connection_kwargs
    settings.REDIS_URL = f"redis://cp-limited:cp-pw@{kwargs['host']}:{kwargs['port']}/{kwargs['db']}"
    try:
        with pytest.raises(
            CommandError, match=r"the control plane's Redis user may not make users .*: an administrator"
        ):
            call_command("node_credential", "acl", "n1", "--apply")
        assert node_acl.user_name("n1") not in admin.acl_users()
        assert not Event.objects.filter(node="n1").exists()
        # Nor one that Redis cannot be reached by.
        settings.REDIS_URL = "redis://127.0.0.1:1/0"
        with pytest.raises(CommandError, match="Redis cannot be reached to make node n1's user"):
            call_command("node_credential", "acl", "n1", "--apply")
    finally:
        admin.execute_command("ACL", "DELUSER", "cp-limited")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_agent_and_its_replica_under_the_nodes_own_redis_user_register_beat_and_serve(tmp_path, start_agent, staff):
    """The node's user as `node_credential acl NAME --apply` makes it (kept by the control plane:
    it reaches no deployment's queue until one is placed on the node), and an agent given that
    user alone (its replica inherits it): what they do in Redis (the agent's calls and their
    answers, its lease, its queue, its worker's unacknowledged messages, the replica's request
    queue, granted before its start) is all the rules let them do. A Redis 6 refuses the rules
    whole (the test above): the embedded server (Valkey 9) and a Redis 7 take them."""
    import redis

    from inference.management.commands.make_tiny_model import write_tiny_model
    from scheduling.models import Replica

    admin = redis.Redis.from_url(settings.REDIS_URL)
    version = redis_version(admin)
    if version < node_acl.MIN_REDIS:
        pytest.skip("the node's rules need Redis 7: REDIS_URL names a Redis 6")
    node, password = "acl-agent", "pw-of-acl-agent"
    own_url = node_credentials.make_redis_user(node, password, by="test")
    try:
        agent = start_agent(node, "1x4GiB", REDIS_URL=own_url)
        beat = Node.objects.get(name=node).last_heartbeat
        wait_until(lambda: Node.objects.get(name=node).last_heartbeat > beat, 30, "a beat")
        model = write_tiny_model(tmp_path / "tiny", size_mb=2, seed=3).path
        spec = {"name": "acl", "model": {"source": str(model)}, "memory": {"override_bytes": 200 * 1024**2}}

        assert staff.post("/api/deployments/", spec, format="json").status_code == 201, "its agent read the files"
        wait_until(
            lambda: agent.poll() is not None or Replica.objects.filter(state="serving").exists(), 180, "its replica"
        )
        answer = staff.post("/api/deployments/acl/infer/", {"input": "Hi", "params": {"max_tokens": 4}}, format="json")

        assert answer.status_code == 200, answer.json()
        assert agent.poll() is None
        said = (tmp_path / f"agent-{node}.log").read_text()
        assert "NoPermissionError" not in said and "NOPERM" not in said
        records = [json.loads(raw)["id"] for raw in admin.lrange(records_key(node), 0, -1)]
        assert records == [answer.json()["id"]], "its record in the node's own list"
    finally:
        admin.execute_command("ACL", "DELUSER", node_acl.user_name(node))
        admin.delete(*node_acl.unacked_keys(node).values(), records_key(node), queue_grants.until_key(node))
