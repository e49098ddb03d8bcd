"""The `gpuportal` command: parses the command line, calls the API, prints. Every failure ends
with its message on stderr and exit code 1: the API's own message for what it refused, one line
for a portal that cannot be reached."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

from rich.console import Console
from rich.text import Text

from gpuportal.cli import applying, config, nodes, planning, pulling, render, requesting, setting_values, talk, traffic
from gpuportal.cli.client import ApiError, Client, CliError
from gpuportal.cli.options import (
    DEFAULT_TIMEOUT_S,
    JSON,
    YAML,
    add_output_option,
    add_wait_options,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    print_json,
    print_yaml,
)
from gpuportal.cli.waiting import Goal, wait_for
from gpuportal.wire import states
from gpuportal.wire.deployment_spec import BY_NAME as SETTINGS
from gpuportal.wire.deployment_spec import BY_PATH as SETTING_PATHS
from gpuportal.wire.deployment_spec import Setting, Update
from gpuportal.wire.pages import MAX_PAGE_SIZE
from gpuportal.wire.states import ENDED
from gpuportal.wire.states import ReplicaState as S

URL_HELP = f"the portal's address (default: GPUPORTAL_URL, the one login stored, or {config.DEFAULT_URL})"
EVENTS_POLL_S = 1.0
# How often `logs --follow` reads what the replica's process wrote since.
LOG_POLL_S = 1.0
# An event's time is when its transaction wrote it, not when it committed: one written a moment
# before the newest seen may become visible after it. Each poll looks this far back, and the
# ids already printed keep those events from printing twice.
EVENTS_OVERLAP_S = 10.0


class Context:
    """What every command needs: the API client, and where to print."""

    def __init__(self, env: Mapping[str, str], out: Console, err: Console, url: str | None = None):
        self.env, self.out, self.err = env, out, err
        self.url = url  # --url, over GPUPORTAL_URL and the stored one
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            settings = config.load(self.env)
            url = config.normal_url(self.url) if self.url else settings.url
            if not settings.token:
                raise CliError(f"not logged in to {url}: run `gpuportal login` (or set GPUPORTAL_TOKEN)")
            self._client = Client(url, settings.token)
        return self._client

    def token_refused(self) -> str:
        """What to do when the portal refuses the token (401): which token it was says how."""
        if self.env.get("GPUPORTAL_TOKEN"):
            return "the token in GPUPORTAL_TOKEN is not accepted: set a valid one, or unset it to use the stored one"
        return "the stored token is not accepted: `gpuportal login` again"

    def warn(self, message: str) -> None:
        self.err.print(Text(f"warning: {message}", style="yellow"))


def deployment_path(name: str, action: str = "") -> str:
    return f"/api/deployments/{quote(name, safe='')}/" + (f"{action}/" if action else "")


# -- commands --------------------------------------------------------------------------------


def cmd_login(ctx: Context, args: argparse.Namespace) -> int:
    stored = config.load(ctx.env)
    url = config.normal_url(args.url) if args.url else stored.url
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = getpass.getpass(f"password for {args.user} at {url}: ")
    token = Client(url).token(args.user, password)
    path = config.store(config.Settings(url=url, token=token), ctx.env)
    ctx.out.print(Text(f"logged in to {url} as {args.user}; token stored in {path}"))
    if ctx.env.get("GPUPORTAL_URL") and config.normal_url(ctx.env["GPUPORTAL_URL"]) != url:
        ctx.warn(f"GPUPORTAL_URL ({ctx.env['GPUPORTAL_URL']}) overrides the stored URL while it is set")
    if ctx.env.get("GPUPORTAL_TOKEN"):
        ctx.warn("GPUPORTAL_TOKEN overrides the stored token while it is set")
    return 0


# The settings `deploy` takes as arguments of their own, each named as it is given there (and
# stored under the setting's name): --set may not give them a second time.
DEPLOY_FLAGS = {
    "source": "SOURCE",
    "loader": "--loader",
    "dtype": "--dtype",
    "replicas": "--replicas",
    "max_tokens": "--max-tokens",
    "adapters": "--adapters",
}


def deploy_body(args: argparse.Namespace) -> dict[str, Any]:
    """Only what the operator gave: the API fills in its own defaults for the rest. The replica
    count is always sent: --replicas, --set replicas=N, or the spec's default."""
    given = setting_values.parse_assignments(getattr(args, "set", None) or [], "deploy", changing=False)
    flags = {name: getattr(args, name) for name in DEPLOY_FLAGS if name != "source"}
    for setting, _ in given:
        if setting.name == "source" or flags.get(setting.name) is not None:
            raise CliError(f"deploy: {setting.path} is given by {DEPLOY_FLAGS[setting.name]}: not by --set too")
    from_flags = [(SETTINGS[name], value) for name, value in flags.items() if value is not None]
    body = setting_values.body_of([*from_flags, *given])
    body["name"] = args.name
    body.setdefault("model", {})["source"] = config.model_source(args.source)
    if args.adapters is not None:
        body["model"]["adapters"] = config.adapter_sources(args.adapters)
    body.setdefault("replicas", SETTINGS["replicas"].default)
    # The body's order as the API documents it: name, model, replicas, then the groups.
    return {"name": body.pop("name"), "model": body.pop("model"), "replicas": body.pop("replicas"), **body}


def serving_summary(deployment: dict[str, Any]) -> Text:
    """E.g. "tiny: 1 serving, 1 sleeping (wanted 1)": a wake may leave more serving than wanted."""
    live = render.state_counts(render.live_replicas(deployment))
    return Text(f"{deployment['name']}: {live} (wanted {deployment.get('replicas_wanted', '?')})")


def finish(
    ctx: Context,
    args: argparse.Namespace,
    answer: dict[str, Any],
    goal: Goal,
    *,
    began: float | None = None,
    seen: dict[str, str] | None = None,
) -> int:
    """Wait for the goal unless told not to, then say where the deployment stands. `began` and
    `seen`: when the command's first wait began, and what it printed (a command of two waits)."""
    for warning in answer.get("warnings") or []:
        ctx.warn(warning)
    began = time.monotonic() if began is None else began
    if not args.no_wait:
        answer = wait_for(ctx.client, answer, goal, console=ctx.out, timeout_s=args.timeout, seen=seen)
    line = serving_summary(answer)
    if not args.no_wait:
        line.append(f" after {time.monotonic() - began:.1f} s")
    ctx.out.print(line)
    return 0


def cmd_deploy(ctx: Context, args: argparse.Namespace) -> int:
    answer = ctx.client.post("/api/deployments/", deploy_body(args))
    return finish(ctx, args, answer, Goal(S.SERVING, answer["replicas_wanted"]))


def replica_count(args: argparse.Namespace) -> int:
    if args.count is not None and args.replicas is not None and args.count != args.replicas:
        raise CliError(f"scale: two counts given ({args.count} and --replicas {args.replicas})")
    count = args.count if args.count is not None else args.replicas
    if count is None:
        raise CliError("scale: how many replicas? e.g. `gpuportal scale NAME 3`")
    return count


def cmd_scale(ctx: Context, args: argparse.Namespace) -> int:
    answer = ctx.client.post(deployment_path(args.name, "scale"), {"replicas": replica_count(args)})
    return finish(ctx, args, answer, Goal(S.SERVING, answer["replicas_wanted"]))


# `autoscale`'s flags and the settings they set (group `autoscale` of the spec).
AUTOSCALE_FLAGS = {
    "min": "min_replicas",
    "max": "max_replicas",
    "target": "target_in_flight",
    "down_after": "down_after_s",
}


def cmd_autoscale(ctx: Context, args: argparse.Namespace) -> int:
    given = {key: getattr(args, flag) for flag, key in AUTOSCALE_FLAGS.items() if getattr(args, flag) is not None}
    if args.off and given:
        raise CliError("autoscale: --off takes no other flag")
    if args.off:
        given = {"max_replicas": 0}
    elif not given:  # what it is set to now
        answer = ctx.client.get(deployment_path(args.name))
        ctx.out.print(f"{answer['name']}: {render.autoscale_text(answer)}")
        return 0
    elif "max_replicas" not in given and not ctx.client.get(deployment_path(args.name))["autoscale"]["max_replicas"]:
        raise CliError(f"autoscale: {args.name} is not autoscaled yet: give --max")
    answer = ctx.client.patch(deployment_path(args.name), {"autoscale": given})
    ctx.out.print(f"{answer['name']}: {render.autoscale_text(answer)}")
    return 0


def cmd_wake(ctx: Context, args: argparse.Namespace) -> int:
    answer = ctx.client.post(deployment_path(args.name, "wake"))
    return finish(ctx, args, answer, Goal(S.SERVING, max(1, answer["replicas_wanted"]), at_least=True))


def cmd_retry(ctx: Context, args: argparse.Namespace) -> int:
    answer = ctx.client.post(deployment_path(args.name, "retry"))
    # What it lacks serves; what sleeps was not lacking, and stays asleep.
    lacked = Goal(S.SERVING, answer["replicas_wanted"], at_least=True, also=states.ASLEEP)
    return finish(ctx, args, answer, lacked)


def cmd_set(ctx: Context, args: argparse.Namespace) -> int:
    assignments = setting_values.parse_assignments(args.assignments, "set", changing=True)
    mark = newest_event(ctx, args.name) if setting_values.rolls(assignments) else 0
    rolling = setting_values.set_settings(ctx, args, assignments)
    if rolling is None:
        return 0
    said = (
        f"{args.name}: rolling every replica onto the new model, one at a time; requests meanwhile are served or wait"
    )
    ctx.err.print(Text(said, style="dim"))
    try:
        return finish_rollout(ctx, args, rolling, after_event=mark)
    except CliError as stopped:
        # The change itself is made: say so, and how to roll it out once what stopped it is mended.
        raise CliError(f"{stopped}; the new model is set, and `gpuportal restart {args.name}` rolls it out") from None


def cmd_restart(ctx: Context, args: argparse.Namespace) -> int:
    mark = newest_event(ctx, args.name)
    answer = ctx.client.post(deployment_path(args.name, "restart"), {"misplaced": True} if args.misplaced else None)
    said = f"{args.name}: a rolling restart, one replica at a time; requests meanwhile are served or wait"
    if args.misplaced:
        said = f"{args.name}: moving its replicas off nodes its placement refuses, one at a time, serving meanwhile"
    ctx.err.print(Text(said, style="dim"))
    return finish_rollout(ctx, args, answer, after_event=mark)


def cmd_history(ctx: Context, args: argparse.Namespace) -> int:
    revisions = ctx.client.get(deployment_path(args.name, "revisions"))
    if args.revision is not None:
        # One revision's settings in full, as `kubectl rollout history --revision=N` shows its template.
        found = [revision for revision in revisions if revision["revision"] == args.revision]
        if not found:
            kept = ", ".join(str(revision["revision"]) for revision in reversed(revisions))
            raise CliError(f"history: {args.name} has no revision {args.revision} (kept: {kept})")
        if args.output == JSON:
            print_json(ctx.out, found[0])
            return 0
        for path, value in found[0]["settings"].items():
            ctx.out.print(f"{path}={setting_values.shown(value)}", markup=False, highlight=False)
        return 0
    if args.output == JSON:
        print_json(ctx.out, revisions)
        return 0
    ctx.out.print(render.revisions_table(revisions))
    return 0


def cmd_rollback(ctx: Context, args: argparse.Namespace) -> int:
    mark = newest_event(ctx, args.name)
    answer = ctx.client.post(deployment_path(args.name, "rollback"), {"revision": args.to})
    done = answer["rollback"]
    if not done["changes"]:
        ctx.out.print(Text(f"{args.name}: its settings are revision {done['to']}'s already; nothing changed"))
        return 0
    said = "; ".join(
        setting_values.change_said(SETTING_PATHS[path], change["before"], change["after"])
        for path, change in done["changes"].items()
    )
    ctx.out.print(Text(f"{args.name}: rolled back to revision {done['to']} (now revision {done['revision']}): {said}"))
    if not any(SETTING_PATHS[path].update is Update.ROLLOUT for path in done["changes"]):
        return 0
    ctx.err.print(Text(f"{args.name}: rolling every replica back onto the model, one at a time", style="dim"))
    return finish_rollout(ctx, args, answer, after_event=mark)


def cmd_apply(ctx: Context, args: argparse.Namespace) -> int:
    source = "stdin" if args.file == "-" else args.file
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise CliError(f"apply: cannot read {source}: {err}") from None
    # Every deployment read and checked before the first call: a mistyped file changes nothing.
    wanted = applying.read_all(text, source)
    applied: list[str] = []
    waits: list[Callable[[], int]] = []
    for deployment in wanted:
        try:
            waits += _apply_one(ctx, args, deployment)
        except CliError as err:
            done = ", ".join(applied) or "nothing"
            raise CliError(f"{err} (applied before it: {done}; not {deployment.name} and what follows)") from None
        applied.append(deployment.name)
    if args.prune:
        _prune(ctx, args, {deployment.name for deployment in wanted}, source)
    for wait in waits:
        wait()
    if args.dry_run:
        ctx.err.print(Text("dry run: nothing was sent that changes anything", style="dim"))
    return 0


def _prune(ctx: Context, args: argparse.Namespace, declared: set[str], source: str) -> None:
    """Delete every deployment the file does not declare, once all it declares is applied: the file
    is the whole fleet (docker stack deploy --prune). One a file refused is never reached."""
    for name in sorted(d["name"] for d in ctx.client.pages("/api/deployments/") if d["name"] not in declared):
        if args.dry_run:
            ctx.out.print(Text(f"{name}: would be deleted (not in {source})"))
            continue
        try:
            ctx.client.delete(deployment_path(name))
        except ApiError as err:
            if err.status != 404:
                raise
            continue  # deleted by someone else meanwhile: what --prune wanted
        ctx.out.print(Text(f"{name}: deleted (not in {source}): its replicas stop and their memory is released"))


def _apply_one(ctx: Context, args: argparse.Namespace, deployment: applying.Declared) -> list[Callable[[], int]]:
    """Deploy it, or change what differs; the waits `--wait` asks for."""
    path = deployment_path(deployment.name)
    try:
        answer = ctx.client.get(path)
    except ApiError as err:
        if err.status != 404:
            raise
        if args.dry_run:
            replicas = deployment.settings.get("replicas", SETTINGS["replicas"].default)
            ctx.out.print(Text(f"{deployment.name}: would be deployed, {replicas} replica(s)"))
            return []
        created = ctx.client.post("/api/deployments/", deployment.body())
        ctx.out.print(Text(f"{deployment.name}: deployed, {created['replicas_wanted']} replica(s)"))
        for warning in created.get("warnings") or []:
            ctx.warn(warning)
        each = argparse.Namespace(name=deployment.name, no_wait=False, timeout=args.timeout)
        goal = Goal(S.SERVING, created["replicas_wanted"])
        return [lambda: finish(ctx, each, created, goal)] if args.wait else []
    changes = applying.differing(deployment, answer)
    if not changes:
        ctx.out.print(Text(f"{deployment.name}: unchanged"))
        return []
    said = "; ".join(setting_values.change_said(s, setting_values.current(answer, s), value) for s, value in changes)
    if args.dry_run:
        ctx.out.print(Text(f"{deployment.name}: would change {said}"))
        return []
    mark = newest_event(ctx, deployment.name) if setting_values.rolls(changes) else 0
    after = ctx.client.patch(path, setting_values.body_of(changes))
    ctx.out.print(Text(f"{deployment.name}: {said}"))
    if not (args.wait and mark):
        return []
    each = argparse.Namespace(name=deployment.name, no_wait=False, timeout=args.timeout)
    return [lambda: finish_rollout(ctx, each, after, after_event=mark)]


def newest_event(ctx: Context, name: str) -> int:
    """The id of the deployment's newest Event (0: none): a command's own come after it."""
    newest = ctx.client.get("/api/events/", {"deployment": name, "page_size": 1})["results"]
    return int(newest[0]["id"]) if newest else 0


def finish_rollout(ctx: Context, args: argparse.Namespace, answer: dict[str, Any], *, after_event: int) -> int:
    """Wait for the rolling restart the command began to end (its first steps may have ended it
    already), then say whether it replaced every replica: one that stopped short (no room, failed
    loads) is an error, its reason the one its Event gives. `after_event`: the deployment's newest
    Event before the command; none of the restart's turns after it, none began (nothing ran)."""
    finish(ctx, args, answer, Goal(S.SERVING, 0, at_least=True, rollout=True))
    if args.no_wait:
        return 0
    # Its turns as its Events carry them, newest first: the first end after the command is its own.
    filters = {"deployment": args.name, "kind": "deployment.changed", "page_size": 50}
    for event in ctx.client.get("/api/events/", filters)["results"]:
        if int(event["id"]) <= after_event:
            break
        turn = (event.get("after") or {}).get("rollout")
        if turn == states.Rollout.STOPPED:
            raise CliError(f"{args.name}: {event['reason']}")
        if turn in (states.Rollout.DONE, states.Rollout.BEGAN):
            break
    return 0


def cmd_sleep(ctx: Context, args: argparse.Namespace) -> int:
    # Both put serving replicas to sleep: `sleep` lets them finish what they serve, `evict` does not wait.
    action = "evict" if args.command == "evict" else "sleep"
    deep = getattr(args, "deep", False)
    if deep and args.no_wait:
        raise CliError("sleep: --deep waits for the replicas to sleep before they sleep deeply: drop --no-wait")
    answer = ctx.client.post(deployment_path(args.name, action))
    if not deep:
        return finish(ctx, args, answer, Goal(S.SERVING, 0, towards=S.SLEEPING))
    began, seen = time.monotonic(), {}
    asleep = Goal(S.SERVING, 0, towards=S.SLEEPING)
    wait_for(ctx.client, answer, asleep, console=ctx.out, timeout_s=args.timeout, seen=seen)
    # Asleep, each process writes its weights to its node's shared memory and exits.
    answer = ctx.client.post(deployment_path(args.name, "deep-sleep"))
    deeply = Goal(S.SLEEPING, 0, towards=S.DEEP_SLEEPING, moving=frozenset({S.SLEEPING}))
    return finish(ctx, args, answer, deeply, began=began, seen=seen)


def cmd_rm(ctx: Context, args: argparse.Namespace) -> int:
    """Each named deployment deleted in turn; one the portal refuses (none such, not staff) is
    said and the rest are still deleted, the exit status 1 (as `kubectl delete a b`)."""
    refused = 0
    for name in dict.fromkeys(args.names):
        try:
            ctx.client.delete(deployment_path(name))
        except ApiError as err:
            if err.status == 401:
                raise  # the token: no other name would fare better (main says how to log in again)
            ctx.err.print(Text(f"error: {err}", style="red"))
            refused += 1
            continue
        ctx.out.print(Text(f"deleted {name}: its replicas stop and their memory is released"))
    return 1 if refused else 0


def cmd_ls(ctx: Context, args: argparse.Namespace) -> int:
    if args.name:
        deployments = [ctx.client.get(deployment_path(args.name))]
    else:
        deployments = list(ctx.client.pages("/api/deployments/"))
    if args.output in (JSON, YAML):
        # One deployment named: its object, as `kubectl get deploy NAME -o json` gives one.
        (print_json if args.output == JSON else print_yaml)(ctx.out, deployments[0] if args.name else deployments)
        return 0
    if not deployments:
        ctx.out.print("no deployments; `gpuportal deploy NAME SOURCE` makes one")
        return 0
    ctx.out.print(render.deployments_table(deployments))
    if any(render.live_replicas(d) for d in deployments):
        ctx.out.print()
        ctx.out.print(render.replicas_table(deployments))
    return 0


def cmd_gpus(ctx: Context, args: argparse.Namespace) -> int:
    gpus = list(ctx.client.pages("/api/gpus/", {"node": args.node} if args.node else None))
    if args.output == JSON:
        print_json(ctx.out, gpus)
        return 0
    if not gpus:
        ctx.out.print("no GPUs registered: is a node agent up?")
        return 0
    for number, gpu in enumerate(gpus):
        if number:
            ctx.out.print()
        ctx.out.print(render.gpu_block(gpu, width=args.width))
    ctx.out.print(
        Text(f"\n{render.USED} used  {render.RESERVED} reserved, not in use  {render.FREE} free", style="bright_black")
    )
    return 0


def resolve_replica(client: Client, given: str) -> dict[str, Any]:
    """A replica by its id or an unambiguous start of it (as `ls` shows it): the portal takes
    either; a portal from before it did is searched here."""
    try:
        return client.get(f"/api/replicas/{quote(given, safe='')}/")
    except ApiError as err:
        if err.status != 404:
            raise
    matches = [r for r in client.pages("/api/replicas/") if r["id"].startswith(given)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CliError(f"no replica {given!r}")
    named = ", ".join(f"{r['id']} ({r['deployment']})" for r in matches[:5])
    raise CliError(f"{given!r} could be any of {len(matches)} replicas: {named}")


def resolve_log_target(ctx: Context, given: str) -> dict[str, Any]:
    """The replica `gpuportal logs` shows: one by its id or start, else one of the deployment so
    named (as `kubectl logs deploy/NAME` picks a pod): a serving one first, and a line on stderr
    says which when there are several."""
    try:
        return resolve_replica(ctx.client, given)
    except CliError:
        try:
            deployment = ctx.client.get(f"/api/deployments/{quote(given, safe='')}/")
        except ApiError as err:
            if err.status == 404:
                raise CliError(f"no replica or deployment named {given!r} (`gpuportal ls` lists both)") from None
            raise
    replicas = sorted(deployment["replicas"], key=lambda r: (r["state"] != S.SERVING, r["state"] in ENDED, r["id"]))
    if not replicas:
        raise CliError(f"{given} has no replicas now; `gpuportal events -d {given}` says what became of them")
    chosen = replicas[0]
    if len(replicas) > 1:
        others = ", ".join(r["id"][:8] for r in replicas[1:])
        which = f"{given} has {len(replicas)} replicas: showing {chosen['id'][:8]} (the others: {others})"
        ctx.err.print(Text(which, style="dim"))
    return chosen


def cmd_logs(
    ctx: Context,
    args: argparse.Namespace,
    *,
    pause: Callable[[float], None] = time.sleep,
    polls: int | None = None,
) -> int:
    """A replica's state, its error and its events, then the last lines of its process's own log
    (read on its node by its agent: GET /api/replicas/ID/logs/); with --follow, then each line it
    writes, until it ends or Ctrl-C. `polls` bounds the following, for tests."""
    replica = resolve_log_target(ctx, args.replica)
    head = Text(f"replica {replica['id']} of {replica['deployment']}: ")
    head.append(replica["state"], style=render.STATE_STYLES.get(replica["state"], ""))
    head.append(f" on {render.placement(replica)}")
    if replica.get("pid"):
        head.append(f" (pid {replica['pid']})")
    ctx.out.print(head)
    if replica.get("failure_reason"):
        ctx.out.print(Text(f"failure: {replica['failure_reason']}", style="red"))
    answer = ctx.client.get(
        "/api/events/", {"replica": replica["id"], "page_size": min(MAX_PAGE_SIZE, max(1, args.tail))}
    )
    events = list(reversed(answer.get("results", [])))[-args.tail :] if args.tail else []
    for event in events:
        ctx.out.print(render.event_line(event))
    if answer.get("count", 0) > len(events):
        ctx.out.print(Text(f"({answer['count'] - len(events)} earlier events; --tail N for more)", style="dim"))
    if not replica.get("node"):
        if not args.follow or replica["state"] in ENDED:
            return 0
        try:
            placed = wait_for_a_node(ctx, replica["id"], args.interval, pause, polls)
        except KeyboardInterrupt:
            return 0
        if placed is None:
            return 0
        replica = placed
    try:
        log = ctx.client.get(f"/api/replicas/{replica['id']}/logs/", {"tail": max(1, args.tail)})
    except ApiError as err:  # the agent away, or no process: the events above are what there is
        ctx.out.print(Text(f"its log: {err}", style="dim"))
        return 0
    ctx.out.print(Text(f"{log['path']} on {log['node']}:", style="dim"))
    if log.get("missing"):
        said = "it has not started there yet" if args.follow else "it never started on this node"
        ctx.out.print(Text(f"(no log file there: {said})", style="dim"))
    for line in log["lines"]:
        ctx.out.print(Text(line))
    if not args.follow:
        return 0
    if log.get("end") is None:
        ctx.out.print(Text("(its node's agent is of a release that cannot follow a log)", style="dim"))
        return 0
    try:
        return follow_log(ctx, replica["id"], log["end"], args.interval, pause, polls)
    except KeyboardInterrupt:
        return 0  # the way to stop following, not a failure


def wait_for_a_node(
    ctx: Context, replica_id: str, interval: float, pause: Callable[[float], None], polls: int | None
) -> dict[str, Any] | None:
    """The replica once the books place it on a node (pending placement, or parked until a wake
    loads it); None when it ends first or `polls` run out."""
    ctx.out.print(Text("(on no node yet: waiting for it to be placed)", style="dim"))
    done = 0
    while polls is None or done < polls:
        pause(interval)
        done += 1
        replica = ctx.client.get(f"/api/replicas/{replica_id}/")
        if replica.get("node"):
            return replica
        if replica["state"] in ENDED:
            ctx.out.print(Text(f"(replica {replica_id} has ended)", style="dim"))
            return None
    return None


def follow_log(
    ctx: Context, replica_id: str, end: int, interval: float, pause: Callable[[float], None], polls: int | None
) -> int:
    """Each line the replica's process writes after byte `end` of its log, until it ends (its
    last lines read once more) or `polls` run out."""
    done, seen_ended = 0, False
    while polls is None or done < polls:
        pause(interval)
        done += 1
        try:
            more = ctx.client.get(f"/api/replicas/{replica_id}/logs/", {"since": end})
        except ApiError as err:  # its node away, or the replica on no node any more
            ctx.out.print(Text(f"its log: {err}", style="dim"))
            return 0
        if "state" in more:
            # Read before its lines: those of an ended replica are its last. One request a round.
            ended = more["state"] in ENDED
        else:
            # A portal of an earlier release: the state is asked after the lines, so an end seen
            # now is acted on after one more read, which has the lines written before it.
            ended = seen_ended
            seen_ended = seen_ended or ctx.client.get(f"/api/replicas/{replica_id}/")["state"] in ENDED
        if more.get("skipped"):
            skipped = f"({more['skipped']} bytes of its log skipped: more came than one read holds)"
            ctx.out.print(Text(skipped, style="dim"))
        for line in more["lines"]:
            ctx.out.print(Text(line))
        end = more["end"]
        if ended:
            ctx.out.print(Text(f"(replica {replica_id} has ended)", style="dim"))
            return 0
    return 0


def event_filters(args: argparse.Namespace) -> dict[str, str]:
    given = {"deployment": args.deployment, "kind": args.kind, "replica": args.replica, "node": args.node}
    return {key: value for key, value in given.items() if value}


def no_events(ctx: Context, filters: dict[str, str], *, following: bool) -> str:
    """Why nothing was printed, rather than nothing: what was asked, and where a filter names a
    node or deployment the portal does not have (their history outlives them, so the API cannot
    refuse one), that too. A node named by digits alone was most likely meant as a count."""
    asked = ", ".join(f"{key} {value}" for key, value in filters.items())
    said = f"no event{f' of {asked}' if asked else ''} recorded"
    absent = [
        f"the portal has no {kind} named {filters[kind]} now"
        for kind, path in (("node", "/api/nodes/{}/"), ("deployment", "/api/deployments/{}/"))
        if kind in filters and not _exists(ctx, path.format(quote(filters[kind], safe="")))
    ]
    if absent:
        said += f" ({'; '.join(absent)})"
    if filters.get("node", "").isdigit():
        said += f"; -n names a node: --tail {filters['node']} prints the last {filters['node']} events"
    return said + ("; waiting for new ones (Ctrl-C stops)" if following else "")


def _exists(ctx: Context, path: str) -> bool:
    """False only where the portal says it has no such thing: a hint is never worth a failure (a
    user who is not staff may not read nodes)."""
    try:
        ctx.client.get(path)
    except ApiError as err:
        return err.status != 404
    return True


def recent_events(ctx: Context, filters: dict[str, str], newest: datetime | None) -> list[dict[str, Any]]:
    """The events recorded at most EVENTS_OVERLAP_S before `newest` or since, newest first."""
    params = dict(filters)
    if newest is not None:
        params["since"] = (newest - timedelta(seconds=EVENTS_OVERLAP_S)).isoformat()
    return list(ctx.client.pages("/api/events/", params))


def cmd_events(
    ctx: Context,
    args: argparse.Namespace,
    *,
    pause: Callable[[float], None] = time.sleep,
    polls: int | None = None,
) -> int:
    """The last --tail events, oldest first; with --follow, then each new one as it is recorded,
    until Ctrl-C. `polls` bounds the following, for tests."""
    filters = event_filters(args)
    try:
        answer = ctx.client.get("/api/events/", {**filters, "page_size": min(MAX_PAGE_SIZE, max(1, args.tail))})
        latest = answer.get("results", [])
        show = _event_printer(ctx, args.output)
        for event in reversed(latest[: args.tail] if args.tail else []):
            show(event)
        if not latest:
            ctx.err.print(Text(no_events(ctx, filters, following=args.follow), style="dim"))
        if not args.follow:
            return 0
        newest = max((datetime.fromisoformat(e["time"]) for e in latest), default=None)
        # What is recorded by now is history, printed or not (older than the tail): only what
        # comes after is followed.
        printed = {e["id"]: e["time"] for e in [*latest, *recent_events(ctx, filters, newest)]}
        done = 0
        while polls is None or done < polls:
            pause(args.interval)
            done += 1
            fresh = [e for e in recent_events(ctx, filters, newest) if e["id"] not in printed]
            for event in reversed(fresh):
                show(event)
                printed[event["id"]] = event["time"]
            if printed:
                newest = max(datetime.fromisoformat(t) for t in printed.values())
                window = newest - timedelta(seconds=EVENTS_OVERLAP_S)
                printed = {i: t for i, t in printed.items() if datetime.fromisoformat(t) >= window}
    except KeyboardInterrupt:
        if not args.follow:
            raise
        # The way to stop following, not a failure.
    return 0


def _event_printer(ctx: Context, output: str) -> Callable[[dict[str, Any]], None]:
    if output == JSON:

        def as_json(event: dict[str, Any]) -> None:
            ctx.out.file.write(json.dumps(event) + "\n")
            ctx.out.file.flush()  # a follower reads each as it comes, through a pipe too

        return as_json
    return lambda event: ctx.out.print(render.event_line(event))


def cmd_plan(ctx: Context, args: argparse.Namespace) -> int:
    answer = ctx.client.post("/api/plan/", planning.plan_body(args))
    if args.no_wait:
        ctx.out.print(f"plan {answer['id']}: {answer['state']} (GET /api/plan/{answer['id']}/)")
        return 0
    done = planning.wait_for_plan(ctx.client, answer, console=ctx.err, timeout_s=args.timeout)
    planning.show_plan(done, ctx.out, ctx.err, args.plot)
    return 0


def cmd_pull(ctx: Context, args: argparse.Namespace) -> int:
    answer = ctx.client.post("/api/models/pull/", pulling.pull_body(args))
    if args.no_wait:
        ctx.out.print(f"pull {answer['id']} of {answer['model']}: {answer['state']} (GET {answer['url']})")
        return 0
    done = pulling.wait_for_pull(ctx.client, answer, console=ctx.err, timeout_s=args.timeout)
    return pulling.show_pull(done, ctx.out, ctx.err)


# -- the parser ------------------------------------------------------------------------------


def choices_help(setting: Setting) -> str:
    """E.g. "float32 (default), float16 or bfloat16"."""
    named = [f"{choice} (default)" if choice == setting.default else choice for choice in setting.choices]
    return ", ".join(named[:-1]) + f" or {named[-1]}"


def setting_help(name: str) -> str:
    """A setting's help and default, as the spec declares them."""
    setting = SETTINGS[name]
    default = f"{setting.default:g}" if isinstance(setting.default, float) else setting.default
    return f"{setting.help} Default {default}."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuportal",
        description="Operate a gpuportal through its REST API. `gpuportal login` first; "
        "GPUPORTAL_URL and GPUPORTAL_TOKEN override what it stores.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    parser.add_argument("--url", help=URL_HELP)
    # In the order `--help` lists them: getting started, talking, looking, steering, the record.
    for add in (_add_getting_started, talk.add_talking, _add_looking, _add_steering, _add_the_record):
        add(commands)
    _url_everywhere(parser)
    return parser


def _url_everywhere(parser: argparse.ArgumentParser) -> None:
    """Every command, however deep, takes --url after its name too (`gpuportal ls --url ...`,
    `gpuportal node add gpu-7 --url ...`); given there, it must not be undone by another level's
    default, hence SUPPRESS."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                if not any("--url" in option.option_strings for option in command._actions):
                    command.add_argument("--url", default=argparse.SUPPRESS, help=URL_HELP)
                _url_everywhere(command)


def _add_getting_started(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    login = commands.add_parser("login", help="get a token and store it with the portal's URL")
    login.add_argument("--url", default=argparse.SUPPRESS, help=URL_HELP)
    login.add_argument("--user", default="admin", help="user name (default admin)")
    login.add_argument("--password-stdin", action="store_true", help="read the password from stdin, not a prompt")
    login.set_defaults(run=cmd_login)

    pull = commands.add_parser("pull", help="fetch a Hugging Face model into the nodes' caches, with progress (staff)")
    pull.add_argument(
        "model", help="org/name[@revision], e.g. Qwen/Qwen2.5-0.5B-Instruct, or a name alone as gpt2 (hf: prefix too)"
    )
    pull.add_argument("-n", "--node", help="only this node (default: every node whose agent runs)")
    add_wait_options(pull, "every node has it")
    pull.set_defaults(run=cmd_pull)

    deploy = commands.add_parser("deploy", help="create a deployment and wait until its replicas serve")
    deploy.add_argument("name")
    deploy.add_argument("source", help="a model directory, hf:org/name, or package.module:factory (torch-module)")
    # The flags that mirror a setting say its default and choices as the spec declares them; only
    # what is given is sent (the API fills in the rest), the replica count always.
    replicas, max_tokens = SETTINGS["replicas"], SETTINGS["max_tokens"]
    deploy.add_argument("--replicas", type=non_negative_int, metavar="N", help=f"default {replicas.default}")
    deploy.add_argument(
        "--max-tokens",
        type=non_negative_int,
        metavar="N",
        help=f"longest sequence served (prompt and output; default {max_tokens.default})",
    )
    deploy.add_argument("--loader", help=choices_help(SETTINGS["loader"]))
    deploy.add_argument("--dtype", help=choices_help(SETTINGS["dtype"]))
    deploy.add_argument(
        "--adapters",
        metavar="NAME=SOURCE,...",
        help="LoRA adapters served beside the model, each as the model id NAME:ADAPTER (PEFT directories)",
    )
    deploy.add_argument(
        "--set",
        action="append",
        metavar="SETTING=VALUE",
        help="any other setting, e.g. --set sleep.idle_timeout_s=60 --set failover.standby=true "
        "(`gpuportal set --help` lists them)",
    )
    add_wait_options(deploy, "the replicas serve")
    deploy.set_defaults(run=cmd_deploy)


def _add_looking(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ls = commands.add_parser("ls", help="deployments, their status and replicas")
    ls.add_argument("name", nargs="?", help="only this deployment")
    add_output_option(ls, "the deployments (one, when named; `gpuportal apply -f` reads it back)", with_yaml=True)
    ls.set_defaults(run=cmd_ls)

    gpus = commands.add_parser("gpus", help="a memory bar per GPU: used, reserved, total")
    gpus.add_argument("--node", help="only this node's GPUs")
    gpus.add_argument("--width", type=non_negative_int, default=40, help="cells per bar (default 40)")
    add_output_option(gpus, "the GPUs")
    gpus.set_defaults(run=cmd_gpus)

    nodes.add_looking(commands)
    traffic.add_stats(commands)
    requesting.add_looking(commands)

    logs = commands.add_parser("logs", help="a replica's state, error and events, then its process's log")
    logs.add_argument(
        "replica",
        help="replica id, or its start as `ls` shows it, or a deployment's name (one of its replicas, serving first)",
    )
    logs.add_argument("--tail", type=non_negative_int, default=50, metavar="N", help="last N events (default 50)")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="then print each line its process writes, until it ends or Ctrl-C"
    )
    logs.add_argument(
        "--interval", type=positive_float, default=LOG_POLL_S, metavar="S", help="seconds between reads when following"
    )
    logs.set_defaults(run=cmd_logs)


def _add_steering(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    scale = commands.add_parser("scale", help="set the number of replicas and wait until they serve")
    scale.add_argument("name")
    scale.add_argument("count", nargs="?", type=non_negative_int, metavar="N")
    scale.add_argument("--replicas", type=non_negative_int, metavar="N", help="the same as N")
    add_wait_options(scale, "that many serve")
    scale.set_defaults(run=cmd_scale)

    autoscale = commands.add_parser(
        "autoscale",
        help="scale a deployment by its requests in flight, between --min and --max replicas (no flag: as it is now)",
    )
    autoscale.add_argument("name")
    autoscale.add_argument("--min", type=non_negative_int, metavar="N", help=setting_help("autoscale_min_replicas"))
    autoscale.add_argument("--max", type=non_negative_int, metavar="N", help=setting_help("autoscale_max_replicas"))
    autoscale.add_argument(
        "--target", type=positive_float, metavar="X", help=setting_help("autoscale_target_in_flight")
    )
    autoscale.add_argument(
        "--down-after", type=non_negative_float, metavar="S", help=setting_help("autoscale_down_after_s")
    )
    autoscale.add_argument("--off", action="store_true", help="stop autoscaling: replicas stays where it is")
    autoscale.set_defaults(run=cmd_autoscale)

    for name, help_text in (
        ("sleep", "put serving replicas to sleep once they finish what they serve (weights to CPU RAM)"),
        ("evict", "put serving replicas to sleep now (weights to CPU RAM)"),
    ):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("name")
        add_wait_options(command, "none serves")
        if name == "sleep":
            command.add_argument(
                "--deep",
                action="store_true",
                help="then sleep deeply: each process exits, holding no GPU memory (its weights wait in its "
                "node's shared memory)",
            )
        command.set_defaults(run=cmd_sleep)

    wake = commands.add_parser("wake", help="wake a deployment and wait until it serves")
    wake.add_argument("name")
    add_wait_options(wake, "it serves")
    wake.set_defaults(run=cmd_wake)

    retry = commands.add_parser("retry", help="clear a deployment's failed loads and start what it lacks")
    retry.add_argument("name")
    add_wait_options(retry, "its replicas serve")
    retry.set_defaults(run=cmd_retry)

    restart = commands.add_parser(
        "restart",
        help="replace every replica, one at a time, serving throughout (settings that apply to replicas placed "
        "from now on reach them all); sleepers are parked, not woken",
    )
    restart.add_argument("name")
    restart.add_argument(
        "--misplaced",
        action="store_true",
        help="only the replicas on nodes its node_selector or tolerations refuse now (after a change of them, or "
        "of a node's labels or taints), each replaced where they allow before it stops",
    )
    add_wait_options(restart, "every replica is replaced")
    restart.set_defaults(run=cmd_restart)

    setting_values.add_set(commands, cmd_set)

    apply = commands.add_parser(
        "apply",
        help="deploy what a file declares, or change what differs from it (YAML or JSON, as kubectl apply)",
        description="Each deployment the file declares (the REST body's shape, docs/api.md; one, a list, or "
        "several YAML documents; `gpuportal ls NAME -o yaml` prints one) is deployed where the portal lacks it, "
        "or given the settings the file names that differ (a new model rolls out, one replica at a time). A "
        "setting the file leaves out stays as it is. The whole file is checked before anything is sent.",
    )
    apply.add_argument("-f", "--file", required=True, metavar="FILE", help="the file, or - for stdin")
    applied = apply.add_mutually_exclusive_group()
    applied.add_argument(
        "--wait", action="store_true", help="then wait until each deployed one serves and each new model is rolled out"
    )
    applied.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would be deployed and changed, and send nothing that changes anything (as kubectl's)",
    )
    apply.add_argument(
        "--prune",
        action="store_true",
        help="then delete every deployment the file does not declare: the file is the whole fleet "
        "(as docker stack deploy --prune; with --dry-run, say which)",
    )
    apply.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"with --wait: give up waiting after S seconds each (default {DEFAULT_TIMEOUT_S:.0f})",
    )
    apply.set_defaults(run=cmd_apply)

    history = commands.add_parser(
        "history", help="a deployment's revisions: its settings as each deploy, change or rollback left them"
    )
    history.add_argument("name")
    history.add_argument("--revision", type=positive_int, metavar="N", help="every setting of revision N")
    add_output_option(history, "the revisions")
    history.set_defaults(run=cmd_history)

    rollback = commands.add_parser(
        "rollback",
        help="return a deployment's settings to an earlier revision (a new model rolls out one replica at a time); "
        "the replica count stays",
    )
    rollback.add_argument("name")
    rollback.add_argument(
        "--to", type=positive_int, metavar="N", help="the revision (`gpuportal history`); default: the one before"
    )
    add_wait_options(rollback, "every replica is replaced (where the model goes back)")
    rollback.set_defaults(run=cmd_rollback)

    rm = commands.add_parser("rm", help="delete deployments: their replicas stop")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.set_defaults(run=cmd_rm)

    requesting.add_steering(commands)
    nodes.add_steering(commands)


def _add_the_record(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    events = commands.add_parser("events", help="the audit trail, oldest first")
    events.add_argument("-f", "--follow", action="store_true", help="keep printing new events until Ctrl-C")
    events.add_argument("-d", "--deployment")
    events.add_argument("-k", "--kind", help='e.g. "replica.state", or "replica" for every replica.* kind')
    events.add_argument("-r", "--replica", help="replica id, or its start as ls shows it")
    events.add_argument("-n", "--node")
    events.add_argument("--tail", type=non_negative_int, default=20, metavar="N", help="last N first (default 20)")
    events.add_argument(
        "--interval", type=positive_float, default=EVENTS_POLL_S, metavar="S", help="seconds between polls"
    )
    add_output_option(events, "the events", how=", one a line (JSON Lines, as it follows)")
    events.set_defaults(run=cmd_events)

    plan = commands.add_parser("plan", help="how many GPUs a trace (or the recorded traffic) needs: a capacity plan")
    plan.add_argument("trace", nargs="?", type=Path, help="a trace file (CSV or JSON lines); default: recorded traffic")
    plan.add_argument("--since", help="without a trace: the traffic recorded since (7d, 12h or a time; default 7d)")
    plan.add_argument("--catalogue", type=Path, help="the deployments (JSON, or TOML); default: the portal's own")
    plan.add_argument("--target", type=positive_float, help="share of requests within the SLO (default 0.99)")
    plan.add_argument("--slo", type=positive_float, help="seconds to the first token (default 5)")
    plan.add_argument("--gpu-memory-gib", type=positive_float, help="the GPU kind to plan for")
    plan.add_argument("--gpus", type=non_negative_int, help="GPUs now (default: the portal's count)")
    plan.add_argument(
        "--warm-spares",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan with (or without) a warm spare on every GPU (default: as the portal's GPUs run)",
    )
    plan.add_argument("--skip-bad", action="store_true", help="skip rows that are not requests, listing them")
    plan.add_argument("--plot", type=Path, help="write the attainment plot (PNG) here")
    add_wait_options(plan, "the plan is done")
    plan.set_defaults(run=cmd_plan)


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # soft_wrap: a message or an event is one line however narrow the terminal (or a pipe's 80
    # columns): what scripts grep for is not cut in two. Tables still fit the width.
    out, err = Console(highlight=False, soft_wrap=True), Console(stderr=True, highlight=False, soft_wrap=True)
    ctx = Context(os.environ if env is None else env, out, err, url=args.url)
    try:
        return args.run(ctx, args)
    except CliError as error:
        err.print(Text(f"error: {error}", style="red"))
        if isinstance(error, ApiError) and error.status == 401 and args.command != "login":
            err.print(Text(ctx.token_refused()))
        return 1
    except config.ConfigError as error:
        err.print(Text(f"error: {error}", style="red"))
        return 1
    except KeyboardInterrupt:
        err.print(Text("interrupted: what was asked of the portal goes on there"))
        return 130
