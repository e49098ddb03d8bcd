"""The nodes: `gpuportal nodes` lists them (status, last beat, GPU memory, what runs there),
`gpuportal node drain NAME` takes one out of service and waits until nothing is awake there but
what never sleeps, `node undrain` returns it, `node rm` forgets an offline one, `node label` and
`node taint` set its labels and taints, and `node add`/`node revoke` issue and revoke its
credential. Draining asks
`POST /api/nodes/NAME/drain/`; the wait polls the node's replicas."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from rich.console import Console
from rich.text import Text

from gpuportal.cli import render
from gpuportal.cli.client import Client, CliError
from gpuportal.cli.options import JSON, add_output_option, add_wait_options, print_json
from gpuportal.cli.waiting import POLL_S, STALL_S
from gpuportal.stackenv import write_private
from gpuportal.wire import node_auth, node_labels, states
from gpuportal.wire.states import FailoverState
from gpuportal.wire.states import ReplicaState as S


class Operator(Protocol):
    """What these commands use of the command line's context (gpuportal.cli.app.Context)."""

    out: Console
    err: Console

    @property
    def client(self) -> Client: ...


def node_path(name: str, action: str = "") -> str:
    return f"/api/nodes/{quote(name, safe='')}/" + (f"{action}/" if action else "")


# -- looking -------------------------------------------------------------------------------------


def cmd_nodes(ctx: Operator, args: argparse.Namespace) -> int:
    nodes = list(ctx.client.pages("/api/nodes/"))
    if args.output == JSON:
        print_json(ctx.out, nodes)
        return 0
    if not nodes:
        ctx.out.print("no nodes: start a node agent (`python manage.py agent --node NAME`)")
        return 0
    gpus = list(ctx.client.pages("/api/gpus/"))
    # Stopped ones are left out by the portal (and here too, for one of an earlier release, which
    # ignores the filter): the last hour's history would otherwise be paged through.
    replicas = [
        r for r in ctx.client.pages("/api/replicas/", {"exclude_state": S.STOPPED}) if r.get("state") != S.STOPPED
    ]
    ctx.out.print(render.nodes_table(nodes, gpus, replicas))
    return 0


# -- draining ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drained:
    """Where a draining node stands: the replicas still awake there that will sleep (or are on
    their way), and the failover pairs' active members, which never sleep and keep serving."""

    awake: list[dict[str, Any]]
    kept: list[dict[str, Any]]

    @property
    def done(self) -> bool:
        return not self.awake

    @property
    def moving(self) -> bool:
        return any(r.get("state") in states.IN_TRANSIT for r in self.awake)


def drained(replicas: list[dict[str, Any]]) -> Drained:
    """Of a node's replicas, those still awake there, apart from the pairs' active members."""
    awake = [r for r in replicas if r.get("state") in states.ACTIVE]
    kept = [r for r in awake if r.get("state") == S.SERVING and _pair_state(r) == FailoverState.ACTIVE]
    return Drained([r for r in awake if r not in kept], kept)


def _pair_state(replica: dict[str, Any]) -> str | None:
    """A failover pair member's liveness state, as the API shows it ({"state": ..., "pair": ...});
    None for other replicas."""
    pair = replica.get("failover_state")
    return pair.get("state") if isinstance(pair, dict) else None


def wait_until_drained(
    client: Client,
    name: str,
    *,
    console: Console,
    timeout_s: float,
    moving: bool = False,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> Drained:
    """Poll the node's replicas until none is awake but the pairs' active members; each change of
    a replica's state is a line. CliError when some stay serving with nothing on its way (they
    were not put to sleep; with `moving`, nor is their deployment's move under way) or the wait
    runs out."""
    began = clock()
    stalled_since: float | None = None
    seen: dict[str, str] = {}
    with console.status(f"draining node {name}", spinner="dots") as status:
        while True:
            replicas = list(client.pages("/api/replicas/", {"node": name}))
            for replica in replicas:
                if seen.get(replica["id"], replica.get("state")) != replica.get("state"):
                    line = Text(f"{replica.get('deployment', '?')}: ")
                    line.append_text(render.replica_line(replica))
                    console.print(line)
                seen[replica["id"]] = replica.get("state", "?")
            where = drained(replicas)
            # A failover pair moves as a whole new pair elsewhere: its active member serves here
            # until then, and the wait is for it too. One look at the deployments per poll.
            moves = moving and _moves_under_way(client, [*where.awake, *where.kept])
            if where.done and not moves:
                return where
            status.update(f"draining node {name}: {render.state_counts(where.awake)}")
            now = clock()
            on_its_way = where.moving or moves
            stalled_since = None if on_its_way else (stalled_since if stalled_since is not None else now)
            if stalled_since is not None and now - stalled_since >= STALL_S:
                raise CliError(
                    f"node {name}: {render.state_counts(where.awake)} that do not "
                    f"{'move or ' if moving else ''}go to sleep: "
                    f"see `gpuportal events -n {name}`"
                )
            if now - began >= timeout_s:
                raise CliError(
                    f"node {name}: still {render.state_counts(where.awake)} after {timeout_s:.0f} s;"
                    " the portal goes on without this command waiting"
                )
            pause(POLL_S)


def _moves_under_way(client: Client, awake: list[dict[str, Any]]) -> bool:
    """Whether a deployment of these replicas is moving them (its rolling restart under way)."""
    names = sorted({r["deployment"] for r in awake if r.get("deployment")})
    return any(client.get(f"/api/deployments/{quote(name, safe='')}/").get("rollout") for name in names)


def cmd_node_drain(ctx: Operator, args: argparse.Namespace) -> int:
    ctx.client.post(node_path(args.name, "drain"), {"move": True} if args.move else None)
    if args.no_wait:
        what = "moves to other nodes" if args.move else "goes to sleep"
        ctx.out.print(Text(f"node {args.name} draining: nothing new lands there, and what serves there {what}"))
        return 0
    began = time.monotonic()
    where = wait_until_drained(ctx.client, args.name, console=ctx.out, timeout_s=args.timeout, moving=args.move)
    drained_after = f"node {args.name} drained after {time.monotonic() - began:.1f} s"
    if not where.kept:
        ctx.out.print(Text(f"{drained_after}: nothing awake there"))
        return 0
    pairs = ", ".join(f"{r.get('deployment')} ({render.short_id(r['id'])})" for r in where.kept)
    if args.move:
        how = "their deployments were restarting: drain with --move again once they are done"
    else:
        how = "a drain with --move moves them"
    ctx.out.print(
        Text(
            f"{drained_after}, but for the failover pairs that keep serving there (an active member never "
            f"sleeps; {how}): {pairs}"
        )
    )
    return 0


def cmd_node_undrain(ctx: Operator, args: argparse.Namespace) -> int:
    ctx.client.post(node_path(args.name, "undrain"))
    ctx.out.print(Text(f"node {args.name} is back in service: placement may use it again"))
    return 0


def cmd_node_rm(ctx: Operator, args: argparse.Namespace) -> int:
    ctx.client.delete(node_path(args.name))
    ctx.out.print(
        Text(f"removed node {args.name}: its GPUs left the books (its agent, started again, registers it anew)")
    )
    return 0


# -- labels and taints ---------------------------------------------------------------------------


def mark_changes(items: list[str], what: str) -> dict[str, str | None]:
    """`key=value` sets, `key-` removes (as kubectl label and taint take them); CliError naming a
    bad one before anything is sent."""
    changes: dict[str, str | None] = {}
    for item in items:
        if item.endswith("-") and "=" not in item:
            key, value = item[:-1], None
            problem = node_labels.pair_problem(key, "any")
        else:
            key, equals, value = item.partition("=")
            problem = (
                node_labels.pair_problem(key, value, taint=what == "taints")
                if equals
                else f"{item!r} is not key=value or key-"
            )
        if problem:
            raise CliError(f"{what}: {problem}")
        if key in changes and changes[key] != value:
            raise CliError(f"{what}: {key} given twice")
        changes[key] = value
    return changes


def cmd_node_mark(ctx: Operator, args: argparse.Namespace) -> int:
    what = args.node_command + "s"  # label → labels, taint → taints
    if not args.changes and not args.move:
        raise CliError(f"node {args.node_command}: give KEY=VALUE to set, KEY- to remove, or --move")
    # No change with --move: only what is there already refused moves off.
    changes = {what: mark_changes(args.changes, what)} if args.changes else {}
    node = ctx.client.patch(node_path(args.name), changes)
    # Its GPUs' labels (nvidia.com/gpu.*) are `GET /api/nodes/NAME/`'s to show, as in `gpuportal nodes`.
    shown = render.declared_labels(node) if what == "labels" else node.get(what) or {}
    own = node_labels.text(node.get(f"operator_{what}") or {}) or "none"
    ctx.out.print(Text(f"node {args.name}: {what} {node_labels.text(shown) or 'none'} (set by operators: {own})"))
    if args.move:
        moved = ctx.client.post(node_path(args.name, "move-misplaced"))
        ctx.out.print(Text(moved_line(args.name, moved)))
    return 0


def moved_line(name: str, moved: dict[str, Any]) -> str:
    """What a move of the misplaced off a node does, deployment by deployment."""

    def listed(counts: dict[str, int]) -> str:
        return ", ".join(f"{deployment} ({count})" for deployment, count in sorted(counts.items()))

    if not moved.get("moving") and not moved.get("staying"):
        return f"nothing on node {name} is refused there: nothing to move"
    said = f"moving off node {name}, each replaced elsewhere before it stops: {listed(moved['moving'])}"
    if not moved.get("moving"):
        said = f"nothing moves off node {name} now"
    if moved.get("staying"):
        said += f"; staying until their restarts are done: {listed(moved['staying'])}"
    return said


# -- credentials ---------------------------------------------------------------------------------


def cmd_node_add(ctx: Operator, args: argparse.Namespace) -> int:
    path: Path | None = args.token_file
    if path is not None:
        _check_writable(path)  # before the token is issued: a previous one is refused from then on
    answer = ctx.client.post(node_path(args.name, "credential"))
    start = f"python manage.py agent --node {args.name}"
    if path is not None:
        try:
            write_private(path, answer["token"] + "\n")
        except OSError as err:
            ctx.out.print(answer["token"], markup=False)
            raise CliError(f"--token-file {path}: {err.strerror or err}; the token is printed above instead") from None
        ctx.err.print(
            Text(
                f"node {args.name}'s credential: its token is in {path} (mode 0600; a previous one is refused from "
                f"now on). Start its agent with {node_auth.TOKEN_FILE_ENV}={path} {start}"
            )
        )
        return 0
    # The token on stdout alone, so `gpuportal node add gpu-7 > token` captures just it; how to
    # pass it on, on stderr.
    ctx.out.print(answer["token"], markup=False)
    ctx.err.print(
        Text(
            f"node {args.name}'s credential: the token above is shown only this once (a previous one is refused "
            f"from now on). Put it in a file (mode 0600, or --token-file FILE) on the node's host and start its "
            f"agent with {node_auth.TOKEN_FILE_ENV}=FILE {start}"
        )
    )
    return 0


def _check_writable(path: Path) -> None:
    """A CliError unless `path` can be written (its folder made where it is missing)."""
    if path.is_dir():
        raise CliError(f"--token-file {path} is a folder")
    folder = next(p for p in (path.absolute().parent, *path.absolute().parents) if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"--token-file {path}: cannot write in {folder}")


def cmd_node_revoke(ctx: Operator, args: argparse.Namespace) -> int:
    ctx.client.delete(node_path(args.name, "credential"), params={"reason": args.reason} if args.reason else None)
    ctx.out.print(
        Text(f"revoked node {args.name}'s credential: its calls are refused, and its replicas are replaced elsewhere")
    )
    return 0


# -- the parsers ---------------------------------------------------------------------------------


def add_looking(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    listed = commands.add_parser("nodes", help="the nodes: status, last beat, GPU memory, what runs on each")
    add_output_option(listed, "the nodes")
    listed.set_defaults(run=cmd_nodes)


def add_steering(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    node = commands.add_parser(
        "node", help="drain a node or return it to service, remove a retired one; issue or revoke its credential"
    )
    actions = node.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    drain = actions.add_parser(
        "drain", help="take the node out of service: nothing new lands there, what serves there goes to sleep (staff)"
    )
    drain.add_argument("name")
    drain.add_argument(
        "--move",
        action="store_true",
        help="move what serves there to other nodes, each replaced before it stops (as kubectl drain), rather than "
        "put it to sleep there",
    )
    add_wait_options(drain, "nothing is awake there")
    drain.set_defaults(run=cmd_node_drain)
    undrain = actions.add_parser("undrain", help="return a drained node to service (staff)")
    undrain.add_argument("name")
    undrain.set_defaults(run=cmd_node_undrain)
    rm = actions.add_parser("rm", help="remove an offline node (a retired host) and its GPUs from the books (staff)")
    rm.add_argument("name")
    rm.set_defaults(run=cmd_node_rm)
    for verb, example, effect in (
        ("label", "gpu=h100 zone-", "a deployment's placement.node_selector matches them"),
        (
            "taint",
            "team=research",
            "only deployments whose placement.tolerations name each are placed there; KEY=VALUE:NoExecute also "
            "moves off what runs there and does not tolerate it, each replica replaced elsewhere first; "
            "KEY=VALUE:PreferNoSchedule keeps nothing off, but the node is placement's last choice",
        ),
    ):
        marking = actions.add_parser(
            verb,
            help=f"set or remove the node's {verb}s over its agent's, as kubectl {verb} (staff)",
            description=(
                f"Set KEY=VALUE or remove KEY- {verb}s of a node ({effect}), over what its agent says; they outlive "
                f"the agent's restarts. Example: gpuportal node {verb} NODE {example}"
            ),
        )
        marking.add_argument("name")
        marking.add_argument("changes", nargs="*", metavar="KEY=VALUE|KEY-")
        marking.add_argument(
            "--move",
            action="store_true",
            help="then move off the node what its deployments' placement refuses there now, each replica replaced "
            "elsewhere before it stops (as a NoExecute taint evicts)",
        )
        marking.set_defaults(run=cmd_node_mark)
    add = actions.add_parser("add", help="issue the node's credential and print its token, once (staff)")
    add.add_argument("name", help="the node's name, as its agent's --node")
    add.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=f"write the token to FILE, readable by its owner alone, for the agent's {node_auth.TOKEN_FILE_ENV} "
        "(default: print it)",
    )
    add.set_defaults(run=cmd_node_add)
    revoke = actions.add_parser("revoke", help="revoke the node's credential: it is written off (staff)")
    revoke.add_argument("name")
    revoke.add_argument("--reason", help="why, for the audit trail")
    revoke.set_defaults(run=cmd_node_revoke)
