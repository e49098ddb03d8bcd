"""What the commands print, from the API's JSON: pure functions of it, so they are tested without
a portal. Strings from the API go into rich Text, never into markup: a reason with brackets in it
must print as written."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from rich.table import Table
from rich.text import Text

from gpuportal.cli.setting_values import changed_text
from gpuportal.wire import node_labels
from gpuportal.wire.states import DISPLAY_ORDER, DeploymentStatus, NodeStatus, sits_on
from gpuportal.wire.states import ReplicaState as S

# Shown in `ls` in states.DISPLAY_ORDER; stopped replicas are history and not counted.
STATE_STYLES = {
    S.SERVING: "green",
    S.STANDBY: "cyan",
    S.SLEEPING: "blue",
    S.DEEP_SLEEPING: "blue",
    S.FAILED: "red",
    S.PENDING: "yellow",
    S.LOADING: "yellow",
    S.WAKING: "yellow",
    S.DRAINING: "magenta",
    S.STOPPING: "magenta",
    S.PARKED: "bright_black",
    S.STOPPED: "bright_black",
}
STATUS_STYLES = {DeploymentStatus.OK: "green", DeploymentStatus.RETRYING: "yellow", DeploymentStatus.FAILED: "red"}
NODE_STYLES = {NodeStatus.ONLINE: "green", NodeStatus.DRAINING: "magenta", NodeStatus.OFFLINE: "red"}
# Deployments get a colour each in the GPU bars, stable across runs (not Python's salted hash).
PALETTE = ("green", "cyan", "magenta", "yellow", "blue", "bright_green", "bright_cyan", "bright_magenta")

USED, RESERVED, FREE, FOREIGN = "█", "▒", "░", "▓"
BAR_STYLES = {USED: "green", RESERVED: "yellow", FREE: "bright_black", FOREIGN: "red"}


def short_id(replica_id: str) -> str:
    """Enough of an opaque id to tell replicas apart on screen; `logs` takes it back."""
    return replica_id[:8]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def local_time(iso: str | None) -> str:
    """An API timestamp in the operator's time zone, to the second."""
    if not iso:
        return "-"
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return iso


def since(iso: str | None, now: datetime | None = None) -> str:
    """How long ago an API timestamp was, as `ago` says it ("12 min ago"), or "-" when there is
    none. A time a little ahead of this machine's clock (the portal's clock and this one differ)
    reads as "0 s ago" rather than a negative age."""
    if not iso:
        return "-"
    try:
        then = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    now = now or datetime.now(then.tzinfo)
    return ago(max(0.0, (now - then).total_seconds()))


def colour_of(deployment: str) -> str:
    return PALETTE[sum(deployment.encode()) % len(PALETTE)]


def live_replicas(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in deployment.get("replicas", []) if r.get("state") != S.STOPPED]


def state_counts(replicas: Iterable[dict[str, Any]]) -> str:
    """E.g. "2 serving, 1 loading": the states present, in the order an operator reads them."""
    counts = Counter(r.get("state") for r in replicas if r.get("state") != S.STOPPED)
    ordered = [s for s in DISPLAY_ORDER if counts[s]] + sorted(s for s in counts if s not in DISPLAY_ORDER)
    return ", ".join(f"{counts[s]} {s}" for s in ordered) or "none"


def placement(replica: dict[str, Any]) -> str:
    """Where a replica is: node/gpu indexes, e.g. "box/0+1"; "-" before it is placed."""
    node = replica.get("node")
    if not node:
        return "-"
    # gpu_indexes: on its node, as NODE/INDEX names a GPU everywhere else (gpus: older portals).
    occupied = replica.get("gpu_indexes", replica.get("gpus")) or []
    gpus = sits_on(replica.get("state", ""), occupied, replica.get("gpu_mem_bytes_by_id") or {})
    return f"{node}/{'+'.join(str(g) for g in gpus)}" if gpus else node


def replica_line(replica: dict[str, Any]) -> Text:
    state = replica.get("state", "?")
    line = Text(f"{short_id(replica['id'])} ")
    line.append(state, style=STATE_STYLES.get(state, ""))
    line.append(f" {placement(replica)}")
    if state == S.LOADING and replica.get("progress") is not None:
        line.append(f" {replica['progress']} %")
    if state == S.FAILED and replica.get("failure_reason"):
        line.append(f" {replica['failure_reason']}", style="red")
    return line


def autoscale_text(deployment: dict[str, Any]) -> str:
    """E.g. "autoscaled between 1 and 4 replicas, 4 requests in flight each; fewer after 300 s",
    then what the autoscaler last measured: "last measured 2 s ago: 9 request(s) in flight, wanting
    3 replica(s); 2 set"."""
    auto = deployment.get("autoscale") or {}
    if not auto.get("max_replicas"):
        return f"not autoscaled: {deployment.get('replicas_wanted', '?')} replica(s) kept as set"
    target = auto["target_in_flight"]
    text = (
        f"autoscaled between {auto['min_replicas']} and {auto['max_replicas']} replicas, "
        f"{target:g} {'request' if target == 1 else 'requests'} in flight each; fewer after {auto['down_after_s']:g} s"
    )
    if load := auto.get("load"):
        text += (
            f"\nlast measured {ago(load['age_s'])}: {load['in_flight']} request(s) in flight, wanting "
            f"{load['wanted']} replica(s); {deployment.get('replicas_wanted', '?')} set"
        )
    return text


def deployments_table(deployments: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "STATUS", "SERVING", "STATES", "MEMORY", "SOURCE"):
        table.add_column(column, overflow="fold")
    for deployment in deployments:
        live = live_replicas(deployment)
        serving = sum(1 for r in live if r.get("state") == S.SERVING)
        status = deployment.get("status", "?")
        status_text = Text(status, style=STATUS_STYLES.get(status, ""))
        if status != "ok" and deployment.get("failed_reason"):
            status_text.append(f": {deployment['failed_reason']}")
        if rollout := deployment.get("rollout"):
            status_text.append(f", {'moving' if rollout.get('move') else 'restarting'} ({rollout['left']} left)")
        table.add_row(
            Text(deployment["name"]),
            status_text,
            f"{serving}/{deployment.get('replicas_wanted', '?')}" + _auto_bounds(deployment),
            state_counts(live),
            human_bytes((deployment.get("memory") or {}).get("need_bytes")),
            Text((deployment.get("model") or {}).get("source", "")),
        )
    return table


def revisions_table(revisions: list[dict[str, Any]]) -> Table:
    """`gpuportal history`: a deployment's revisions, oldest first as `kubectl rollout history`
    lists them, the current one marked."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("REVISION", "WHEN", "BY", "CAUSE", "CHANGES"):
        table.add_column(column, overflow="fold")
    for revision in reversed(revisions):
        changes = revision.get("changes")
        said = "; ".join(changed_text(path, c["before"], c["after"]) for path, c in changes.items()) if changes else "-"
        number = Text(str(revision["revision"]))
        if revision.get("current"):
            number.append(" (current)", style="green")
        table.add_row(
            number,
            since(revision.get("at")),
            Text(revision.get("by") or "-"),
            Text(revision.get("cause", "")),
            Text(said if changes is not None else "(the oldest kept)" if revision.get("revision") != 1 else "-"),
        )
    return table


def _auto_bounds(deployment: dict[str, Any]) -> str:
    auto = deployment.get("autoscale") or {}
    return f" (auto {auto['min_replicas']}–{auto['max_replicas']})" if auto.get("max_replicas") else ""


def replicas_table(deployments: list[dict[str, Any]]) -> Table:
    """Every replica that is not history (stopped), under the deployments: where it is, and what
    it is doing or why it failed."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("REPLICA", "DEPLOYMENT", "STATE", "ON", "PID", "NOTE"):
        table.add_column(column, overflow="fold")
    for deployment in deployments:
        for replica in live_replicas(deployment):
            state = replica.get("state", "?")
            note = ""
            if state == S.LOADING and replica.get("progress") is not None:
                note = f"{replica['progress']} % loaded"
            elif state == S.FAILED:
                note = replica.get("failure_reason") or ""
            elif replica.get("role") == "standby":
                note = "failover standby"
            table.add_row(
                short_id(replica["id"]),
                Text(deployment["name"]),
                Text(state, style=STATE_STYLES.get(state, "")),
                Text(placement(replica)),
                str(replica.get("pid") or "-"),
                Text(note, style="red" if state == S.FAILED else ""),
            )
    return table


def ago(seconds: float | None) -> str:
    """E.g. "3 s ago", "12 min ago": how long since something happened, to a unit an operator reads."""
    if seconds is None:
        return "never"
    for unit, size in (("d", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def bytes_of(part: int | None, whole: int | None) -> str:
    """E.g. "1.6 / 47.1 GiB", or "40.0 MiB / 11.8 GiB" where the units differ."""
    shown, of = human_bytes(part), human_bytes(whole)
    number, _, unit = shown.partition(" ")
    return f"{number} / {of}" if of.endswith(f" {unit}") else f"{shown} / {of}"


def nodes_table(nodes: list[dict[str, Any]], gpus: list[dict[str, Any]], replicas: list[dict[str, Any]]) -> Table:
    """A row per node: its status, its last beat, its GPUs' memory (reserved / total, and what
    other tenants hold), the states of the replicas on it, its host cache (used / budget), and,
    where any node's agent or an operator declared labels or taints, those (what deployments' node
    selectors match, and what their tolerations must name; the labels its GPUs give it,
    `nvidia.com/gpu.*`, are the API's and `gpus`' to show)."""
    # One space between columns: a row of a fleet's node fits 80 columns (without labels).
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    declared = {node["name"]: declared_labels(node) for node in nodes}
    labelled = any(declared.values())
    tainted = any(node.get("taints") for node in nodes)
    columns = ("NAME", "STATUS", "LAST BEAT", "GPUS", "RESERVED", "REPLICAS", "HOST CACHE")
    for column in (*columns, *(["LABELS"] if labelled else []), *(["TAINTS"] if tainted else [])):
        table.add_column(column, overflow="fold")
    for node in nodes:
        its_gpus = [g for g in gpus if g.get("node") == node["name"]]
        reserved = sum(g.get("reserved_bytes", 0) for g in its_gpus)
        total = sum(g.get("total_bytes", 0) for g in its_gpus)
        memory = Text(bytes_of(reserved, total))
        # Other tenants: what other processes hold, less the node's own warm spares.
        others = sum(max(0, g.get("foreign_bytes", 0) - (g.get("spare_bytes") or 0)) for g in its_gpus)
        if others:
            memory.append(f", other tenants {human_bytes(others)}", style="red")
        status = node.get("status", "?")
        count = node.get("gpu_count", len(its_gpus))
        table.add_row(
            Text(node["name"]),
            Text(status, style=NODE_STYLES.get(status, "")),
            ago(node.get("heartbeat_age_s")),
            f"{count}{' virtual' if node.get('virtual') else ''}",
            memory,
            state_counts(r for r in replicas if r.get("node") == node["name"]),
            bytes_of(node.get("host_cache_used_bytes"), node.get("host_cache_budget_bytes")),
            *([node_labels.text(declared[node["name"]]) or "-"] if labelled else []),
            *([node_labels.text(node.get("taints") or {}) or "-"] if tainted else []),
        )
    return table


def declared_labels(node: dict[str, Any]) -> dict[str, str]:
    """A node's labels but those its GPUs give it (`nvidia.com/gpu.*`), unless an operator set one."""
    set_here = node.get("operator_labels") or {}
    labels: dict[str, str] = node.get("labels") or {}
    return {key: value for key, value in labels.items() if key not in node_labels.GPU_KEYS or key in set_here}


def used_bytes(gpu: dict[str, Any]) -> int | None:
    """What the portal's replica processes hold as the agent last measured it (NVML, or a virtual
    GPU's model of it): its allocatable total less what was free and what other tenants hold. None
    before the first measurement."""
    free = gpu.get("nvml_free_bytes")
    if free is None:
        return None
    return max(0, gpu["total_bytes"] - free - gpu.get("foreign_bytes", 0))


def memory_bar(total: int, reserved: int, used: int | None, width: int = 40, foreign: int = 0) -> str:
    """`width` cells over the GPU's allocatable memory: USED what processes hold within the
    reservations, RESERVED reserved but not (yet) in use, FREE the rest, and FOREIGN, at the
    end, what other tenants hold. Use past the reservations (an over-commit) shows as used cells
    past the reserved ones."""
    if total <= 0 or width <= 0:
        return ""

    def cells(n: int) -> int:
        return max(0, min(width, round(width * n / total)))

    foreign_cells = cells(foreign)
    room = width - foreign_cells
    reserved_cells = min(room, cells(reserved))
    used_cells = 0 if used is None else min(room, cells(used))
    if used_cells <= reserved_cells:
        bar = USED * used_cells + RESERVED * (reserved_cells - used_cells) + FREE * (room - reserved_cells)
    else:
        bar = USED * used_cells + FREE * (room - used_cells)
    return bar + FOREIGN * foreign_cells


def gpu_block(gpu: dict[str, Any], width: int = 40) -> Text:
    """One GPU: its name, its bar, the figures, and whose reservations fill it."""
    total, reserved = gpu["total_bytes"], gpu.get("reserved_bytes", 0)
    used = used_bytes(gpu)
    head = Text(f"{gpu['node']}/{gpu['index']}", style="bold")
    head.append(f"  (id {gpu['id']}) {gpu.get('product', '')}{' virtual' if gpu.get('virtual') else ''}")
    if gpu.get("health", "ok") != "ok":
        head.append(f"  {gpu['health']}", style="red")
    bar = Text("  [")
    for cell in memory_bar(total, reserved, used, width, foreign=gpu.get("foreign_bytes", 0)):
        bar.append(cell, style=BAR_STYLES[cell])
    bar.append("]")
    figures = Text(
        f"  used {human_bytes(used) if used is not None else 'unmeasured'}"
        f" · reserved {human_bytes(reserved)} · total {human_bytes(total)}"
        f" · free {human_bytes(gpu.get('available_bytes'))}"
    )
    spare = gpu.get("spare_bytes") or 0
    if gpu.get("foreign_bytes", 0) > spare:
        figures.append(f" · other tenants {human_bytes(gpu['foreign_bytes'] - spare)}", style="red")
    if spare:
        figures.append(f" · warm spare {human_bytes(spare)}")
    if gpu.get("overcommit_bytes"):
        figures.append(f" · over-committed {human_bytes(gpu['overcommit_bytes'])}", style="red")
    elif used is not None and used > reserved:
        # No over-commit counted: within the books' tolerance, or read before a replica let go of
        # its reservation (a deep sleep or a stop releases it at once; its process's memory shows
        # until the node's next beat). Unexplained, "used 6.6 GiB · reserved 6.4 GiB" reads as a
        # mistake: say by how much, and why it is not one.
        figures.append(
            f" · {human_bytes(used - reserved)} in use past the reservations, not an over-commit"
            " (within tolerance, or a replica letting go)"
        )
    lines = [head, bar, figures]
    for occupant in gpu.get("occupants", []):
        line = Text("  ")
        line.append("■ ", style=colour_of(occupant["deployment"]))
        line.append(
            f"{occupant['deployment']} {human_bytes(occupant['reserved_bytes'])}"
            f" {occupant.get('state', '')} ({short_id(occupant['replica'])})"
        )
        lines.append(line)
    for intent in gpu.get("intents", []):
        lines.append(Text(f"  waiting: {intent['deployment']} needs {human_bytes(intent['needed_bytes'])}"))
    return Text("\n").join(lines)


def event_line(event: dict[str, Any]) -> Text:
    line = Text(f"{local_time(event.get('time'))}  ")
    line.append(f"{event.get('kind', ''):<18}", style="cyan")
    line.append(f" {event.get('subject', '')}: {event.get('reason', '')}")
    return line
