"""The contract between the planes (gpuportal.wire): what the control plane sends a node
agent, and what an agent calls on the control plane, survive the trip as they were, and what one
side cannot read is refused with what is wrong rather than half-read."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuportal.wire import commands
from gpuportal.wire.control import CALLS, Call, decode_call, encode_call
from gpuportal.wire.node_reports import Books, DeviceInfo, Survivor

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)
gpu_lists = st.lists(st.integers(0, 7), min_size=1, max_size=4).map(tuple)
fractions = st.none() | st.floats(0.01, 1.0)
waits = st.lists(ids, max_size=3).map(tuple)
drains = st.none() | st.floats(0, 600)


@st.composite
def specs(draw) -> commands.ReplicaSpec:
    return commands.ReplicaSpec(
        replica_id=draw(ids),
        source=draw(st.text(min_size=1, max_size=30)),
        loader=draw(st.sampled_from(["auto", "hf-causal-lm", "torch-module"])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        gpus=draw(gpu_lists),
        reserved_bytes_by_gpu={str(i): draw(st.integers(0, 2**40)) for i in draw(gpu_lists)},
        fraction=draw(fractions),
        backend=draw(st.sampled_from(commands.BACKENDS)),
        deployment=draw(ids),
        failover_lease=draw(st.none() | st.integers(1, 10**6)),
        failover_fence=draw(ids),
        role=draw(st.sampled_from(["primary", "standby"])),
        kv_max_tokens=draw(st.none() | st.integers(1, 10**6)),
        context_bytes=draw(st.integers(0, 2**32)),
        adoption_window_s=draw(st.floats(0, 10)),
    )


any_command = st.one_of(
    st.builds(commands.StartReplica, spec=specs(), wait_for=waits),
    st.builds(commands.SleepReplica, replica_id=ids, drain_timeout_s=drains),
    st.builds(
        commands.WakeReplica,
        replica_id=ids,
        gpus=gpu_lists,
        reserved_bytes_by_gpu=st.dictionaries(st.sampled_from("0123"), st.integers(0, 2**40)),
        fraction=fractions,
        wait_for=waits,
    ),
    st.builds(commands.StopReplica, replica_id=ids, drain_timeout_s=drains, close_pair=st.booleans()),
    st.builds(commands.KeepArena, replica_id=ids, keep=st.booleans()),
)


@given(any_command)
def test_every_command_comes_back_from_its_json_as_it_was_sent(command):
    assert commands.decode(json.loads(json.dumps(commands.encode(command)))) == command


def test_no_command_carries_a_database_url():
    # A node holds no database credentials: its failover pairs lock on the node (inference.failover).
    names = {f.name for kind in commands.KINDS.values() for f in fields(kind)} | {
        f.name for f in fields(commands.ReplicaSpec)
    }
    assert not {n for n in names if "dsn" in n or "database" in n}, names


def test_a_stop_from_an_older_control_plane_closes_no_pair():
    # close_pair came to version 1 with a default: a stop without it reads as it did before.
    payload = {"v": commands.VERSION, "kind": "stop", "replica_id": "r1", "drain_timeout_s": 5.0}
    assert commands.decode(payload) == commands.StopReplica("r1", 5.0, close_pair=False)


A_SPEC = {"replica_id": "r1", "source": "/m", "loader": "auto", "dtype": "float32", "gpus": [0]}
A_SPEC["reserved_bytes_by_gpu"] = {"0": 1}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "a command is a JSON object, not list"),
        ({"v": 2, "kind": "stop", "replica_id": "r1"}, "command version 2 is not this agent's (1)"),
        ({"kind": "stop", "replica_id": "r1"}, "command version None is not this agent's"),
        ({"v": 1, "kind": "reboot", "replica_id": "r1"}, "unknown command kind 'reboot' (known: start, sleep"),
        ({"v": 1, "kind": "stop"}, "a stop command with bad fields"),
        ({"v": 1, "kind": "stop", "replica_id": "r1", "colour": "red"}, "a stop command with bad fields"),
        ({"v": 1, "kind": "start", "spec": {"replica_id": "r1"}}, "a start command with bad fields"),
        ({"v": 1, "kind": "start", "spec": {**A_SPEC, "backend": "tpu"}}, "unknown backend 'tpu'"),
        ({"v": 1, "kind": "start", "spec": {**A_SPEC, "replica_id": "../etc"}}, "must be letters, digits"),
    ],
)
def test_a_command_this_side_cannot_read_is_refused_naming_why(payload, message):
    with pytest.raises(commands.WireError, match=message.replace("(", r"\(").replace(")", r"\)")):
        commands.decode(payload)


device_infos = st.builds(
    DeviceInfo,
    index=st.integers(0, 7),
    uuid=ids,
    product=st.text(max_size=20),
    total_bytes=st.integers(0, 2**40),
    virtual=st.booleans(),
    nvml_total_bytes=st.none() | st.integers(0, 2**40),
    context_bytes=st.none() | st.integers(0, 2**31),
)
survivors = st.builds(Survivor, replica_id=ids, pid=st.integers(1, 2**22), state=ids, last=st.none() | ids)
books = st.builds(
    Books,
    usage=st.dictionaries(ids, st.dictionaries(st.sampled_from("0123"), st.integers(0, 2**40)), max_size=3),
    states=st.dictionaries(ids, ids, max_size=3),
    free_by_index=st.none() | st.dictionaries(st.sampled_from("0123"), st.integers(0, 2**40)),
)
events = st.dictionaries(st.sampled_from(["event", "reason", "pid"]), st.text(max_size=10) | st.integers())
any_call = st.one_of(
    st.builds(
        lambda node, devices, survivors, cache, virtual: Call(
            "register_node",
            "gp:r",
            (node, devices),
            {"hostname": "h", "cpu_cache_bytes": cache, "virtual": virtual, "survivors": survivors},
        ),
        ids,
        st.lists(device_infos, max_size=3),
        st.lists(survivors, max_size=3),
        st.integers(0, 2**40),
        st.booleans(),
    ),
    st.builds(
        lambda node, b, running: Call("heartbeat", "gp:r", (node,), {"books": b, "running": running}),
        ids,
        st.none() | books,
        st.lists(ids, max_size=3),
    ),
    st.builds(lambda node, reason: Call("node_stopping", "gp:r", (node, reason)), ids, st.text(max_size=20)),
    st.builds(lambda node, reason: Call("node_stopped", "gp:r", (node, reason)), ids, st.text(max_size=20)),
    st.builds(lambda rid, event: Call("report", "gp:r", (rid, event)), ids, events),
    st.builds(lambda rid: Call("replica_state", "gp:r", (rid,)), ids),
)


@given(any_call)
def test_every_call_of_an_agent_comes_back_from_its_json_as_it_was_made(call):
    back = decode_call(json.loads(json.dumps(encode_call(call))))
    assert back.name == call.name and back.reply_to == call.reply_to
    assert list(back.args) == [list(a) if isinstance(a, tuple) else a for a in call.args]
    assert back.kwargs == call.kwargs


def test_the_calls_are_the_control_planes_methods():
    from gpuportal.wire.control import ControlPlane

    assert set(CALLS) == {name for name in vars(ControlPlane) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("report", "a call is a JSON object, not str"),
        ({"v": 9, "call": "report", "reply_to": "k"}, "call version 9 is not the control plane's"),
        ({"v": 1, "call": "reboot", "reply_to": "k"}, "unknown call 'reboot'"),
        ({"v": 1, "call": "report", "reply_to": ""}, "a report call names no reply_to list"),
        ({"v": 1, "call": "report", "reply_to": "k", "args": "r1"}, "a report call with bad arguments"),
        ({"v": 1, "call": "register_node", "reply_to": "k", "args": ["n"]}, "a register_node call with bad fields"),
        (
            {"v": 1, "call": "heartbeat", "reply_to": "k", "args": ["n"], "kwargs": {"books": {"cpu": 1}}},
            "a heartbeat call with bad fields",
        ),
    ],
)
def test_a_call_the_control_plane_cannot_read_is_refused_naming_why(payload, message):
    with pytest.raises(commands.WireError, match=message):
        decode_call(payload)


def test_a_call_that_is_no_control_plane_method_cannot_be_sent():
    with pytest.raises(commands.WireError, match="unknown call 'shutdown'"):
        encode_call(Call("shutdown", "gp:r"))


def test_both_sides_of_the_agent_calls_carry_exactly_the_contracts_calls():
    # The interface is written once (gpuportal.wire.control.ControlPlane); each side only names
    # the calls, so one it misses, or one the contract lacks, fails here rather than on a node.
    from gpuportal.wire.control import CALLS, OPTIONAL, TIMEOUTS_S, ControlPlane
    from inference.gateway import RemoteControl
    from scheduling.services.node_gateway import ServicesGateway

    declared = {name for name in vars(ControlPlane) if not name.startswith("_")}
    assert set(CALLS) == declared
    for side in (RemoteControl, ServicesGateway):
        assert all(callable(getattr(side, name, None)) for name in CALLS), side
    assert set(TIMEOUTS_S) <= declared and set(OPTIONAL) <= declared
