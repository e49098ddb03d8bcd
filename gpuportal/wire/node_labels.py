"""A node's labels and taints and a deployment's node selector and tolerations, as Kubernetes has
them for pods: an agent declares what its host is (`--labels gpu=h100,zone=b`,
GPUPORTAL_NODE_LABELS), its GPUs say what they are (`gpu_labels`, named as NVIDIA's GPU feature
discovery names them on Kubernetes), and a deployment's `placement.node_selector` (`gpu=h100`)
keeps its replicas on the nodes whose labels hold every pair it names. The other way round, an
agent's taints (`--taints team=research`, GPUPORTAL_NODE_TAINTS) keep every deployment off its node
but those whose `placement.tolerations` name each of them (`key=value`, or a bare `key` for any
value of it). A taint keeps new replicas off (Kubernetes' NoSchedule: what runs there stays), or,
written `key=value:NoExecute`, also moves off what runs there and does not tolerate it
(`evicting`); `key=value:PreferNoSchedule` only makes its node placement's last choice
(`avoidances`). All are written `key=value,key=value`. Operators set labels and taints of their own
over the agent's (`changed`,
`merged`): `gpuportal node label`/`taint`, as `kubectl label`/`taint`. Django-free: the agent, the
CLI, the API's input and placement read the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import cast

from gpuportal.wire.memory import MiB
from gpuportal.wire.node_reports import DeviceInfo

# Kubernetes' label syntax, as its users write it: a name of letters, digits, '-', '_' and '.'
# starting and ending with a letter or digit, at most 63, optionally behind a DNS prefix and '/'.
_NAME = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
KEY = re.compile(rf"({_NAME}/)?{_NAME}")
VALUE = re.compile(_NAME)
RULE = (
    "key=value pairs separated by commas, each key and value letters, digits, '-', '_' and '.', "
    "starting and ending with a letter or digit, at most 63 (a key may have a prefix and '/')"
)
MAX_PAIRS = 32
MAX_TEXT = 2_000

# A taint's effect, after its value as kubectl writes it (`team=research:NoExecute`). NoSchedule,
# the default, keeps new replicas off and leaves what runs there; NoExecute also moves it off,
# each replica replaced elsewhere before it stops (stopped where there is no room, as Kubernetes
# evicts); PreferNoSchedule keeps nothing off, but placement goes there last, when no other node
# has room without evicting (`avoidances`). A node stores a NoSchedule taint by its value alone,
# as it always has.
NO_SCHEDULE, PREFER_NO_SCHEDULE, NO_EXECUTE = "NoSchedule", "PreferNoSchedule", "NoExecute"
EFFECTS = (NO_SCHEDULE, PREFER_NO_SCHEDULE, NO_EXECUTE)


def taint_of(value: str) -> tuple[str, str]:
    """(value, effect) of a taint as a node holds it: `research` or `research:NoExecute`."""
    bare, colon, effect = value.partition(":")
    return bare, effect if colon else NO_SCHEDULE


def _stored_taint(value: str) -> str:
    bare, effect = taint_of(value)
    return bare if effect == NO_SCHEDULE else f"{bare}:{effect}"


def parse(text: str, *, taints: bool = False) -> dict[str, str]:
    """`key=value,key=value` as a mapping ("" is none); with `taints`, each value may name its
    effect (`key=value:NoExecute`). ValueError naming what is wrong."""
    pairs = cast(dict[str, str], _items(text, bare=False, taints=taints))
    return {key: _stored_taint(value) for key, value in pairs.items()} if taints else pairs


def parse_tolerations(text: str) -> dict[str, str | None]:
    """Tolerations: `key=value` tolerates that taint whatever its effect, a bare `key` any taint
    of that key (Kubernetes' `operator: Exists`), None its value; ValueError naming what is wrong."""
    return _items(text, bare=True)


def _items(text: str, *, bare: bool, taints: bool = False) -> dict[str, str | None]:
    if len(text) > MAX_TEXT:
        raise ValueError(f"at most {MAX_TEXT} characters, got {len(text)}")
    pairs: dict[str, str | None] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, equals, value = (side.strip() for side in item.partition("="))
        if not equals and not bare:
            raise ValueError(f"{item!r} is not key=value ({RULE})")
        if bare and ":" in value:
            raise ValueError(
                f"{item!r}: a toleration names a taint whatever its effect: write {key}={taint_of(value)[0]}"
            )
        if problem := pair_problem(key, value if equals else "any", taint=taints):
            raise ValueError(problem)
        given = value if equals else None
        if key in pairs and pairs[key] != given:
            raise ValueError(f"{key} given twice ({pairs[key] or 'any value'} and {given or 'any value'})")
        pairs[key] = given
    if len(pairs) > MAX_PAIRS:
        raise ValueError(f"at most {MAX_PAIRS} pairs, got {len(pairs)}")
    return pairs


def pair_problem(key: object, value: object, *, taint: bool = False) -> str | None:
    """What is wrong with one pair (with `taint`, a taint's, whose value may name its effect), or
    None."""
    if not isinstance(key, str) or not KEY.fullmatch(key):
        return f"{key!r} is no label key ({RULE})"
    if taint and isinstance(value, str) and ":" in value:
        value, effect = taint_of(value)
        if effect not in EFFECTS:
            return (
                f"{effect!r} is no taint effect for {key}: {NO_SCHEDULE} (the default), {PREFER_NO_SCHEDULE} or "
                f"{NO_EXECUTE}"
            )
    if not isinstance(value, str) or not VALUE.fullmatch(value):
        return f"{value!r} is no value for {key} ({RULE})"
    return None


def checked(labels: object, what: str = "labels") -> dict[str, str]:
    """A mapping (`what`: labels or taints) as it comes over the wire, held to the same rules;
    ValueError otherwise."""
    if not isinstance(labels, Mapping):
        raise ValueError(f"{what} must map keys to values, not {labels!r:.200}")
    if len(labels) > MAX_PAIRS:
        raise ValueError(f"at most {MAX_PAIRS} {what}, got {len(labels)}")
    taints = what == "taints"
    for key, value in labels.items():
        if problem := pair_problem(key, value, taint=taints):
            raise ValueError(problem)
    return {key: _stored_taint(value) for key, value in labels.items()} if taints else dict(labels)


def text(pairs: Mapping[str, str]) -> str:
    """The canonical `key=value,...`, keys sorted: what a deployment stores and shows."""
    return ",".join(f"{key}={pairs[key]}" for key in sorted(pairs))


def canonical(selector: str) -> str:
    """A node selector as a deployment stores it (keys sorted, spaces gone); ValueError if bad.
    The spec's check of `placement.node_selector`."""
    return text(parse(selector))


def canonical_tolerations(tolerations: str) -> str:
    """Tolerations as a deployment stores them (keys sorted, a bare key alone); ValueError if bad.
    The spec's check of `placement.tolerations`."""
    pairs = parse_tolerations(tolerations)
    return ",".join(key if pairs[key] is None else f"{key}={pairs[key]}" for key in sorted(pairs))


# The labels a node's GPUs give it, named as NVIDIA's GPU feature discovery labels a Kubernetes node.
GPU_PRODUCT, GPU_COUNT, GPU_MEMORY = "nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/gpu.memory"
GPU_KEYS = (GPU_PRODUCT, GPU_COUNT, GPU_MEMORY)


def gpu_labels(devices: Sequence[DeviceInfo]) -> dict[str, str]:
    """What a node's GPUs say of it: how many, the smallest one's memory in MiB as NVML counts it,
    and their product (`NVIDIA H100 80GB HBM3` as `NVIDIA-H100-80GB-HBM3`) where they all share
    one. None for a node without GPUs. A label its agent declares under the same key wins."""
    if not devices:
        return {}
    memory = min(d.nvml_total_bytes or d.total_bytes for d in devices) // MiB
    labels = {GPU_COUNT: str(len(devices)), GPU_MEMORY: str(memory)}
    products = {d.product for d in devices}
    if len(products) == 1 and (product := _as_value(products.pop())):
        labels[GPU_PRODUCT] = product
    return labels


def _as_value(text: str) -> str:
    """`text` as a label's value: each run of other characters one '-', at most 63, ends trimmed."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:63].rstrip("-._")


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Whether a node with `labels` may run a replica asking for `selector` (every pair held)."""
    return all(labels.get(key) == value for key, value in selector.items())


def untolerated(
    taints: Mapping[str, str], tolerations: Mapping[str, str | None], effects: Sequence[str] = EFFECTS
) -> dict[str, str]:
    """The taints of a node of these `effects` that `tolerations` do not name (pair for pair, or
    by a bare key for any value: `parse_tolerations`): none, and it may run there."""
    return {
        key: value
        for key, value in taints.items()
        if taint_of(value)[1] in effects and not (key in tolerations and tolerations[key] in (None, taint_of(value)[0]))
    }


def keeping_off(taints: Mapping[str, str], tolerations: Mapping[str, str | None]) -> dict[str, str]:
    """Of the taints `tolerations` do not name, those that keep new replicas off (NoSchedule,
    NoExecute): any, and no replica with those tolerations is placed there."""
    return untolerated(taints, tolerations, (NO_SCHEDULE, NO_EXECUTE))


def evicting(taints: Mapping[str, str], tolerations: Mapping[str, str | None]) -> dict[str, str]:
    """Of the taints `tolerations` do not name, the NoExecute ones: any, and what runs there with
    those tolerations is moved off."""
    return untolerated(taints, tolerations, (NO_EXECUTE,))


def merged(agent: Mapping[str, str], operator: Mapping[str, str]) -> dict[str, str]:
    """A node's labels (or taints): what its agent said, with what operators set over them."""
    return {**agent, **operator}


def diff(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """What changed between two sets of labels (or taints), key by key: `pool=fast added`,
    `zone=a removed`, `gpu=a10 → gpu=h100`; "none" where nothing did."""
    parts = []
    for key in sorted({*before, *after}):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        if old is None:
            parts.append(f"{key}={new} added")
        elif new is None:
            parts.append(f"{key}={old} removed")
        else:
            parts.append(f"{key}={old} → {key}={new}")
    return ", ".join(parts) or "none"


def changed(
    agent: Mapping[str, str], operator: Mapping[str, str], changes: Mapping[str, str | None], *, taints: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """The operators' layer of a node's labels (or taints) after `changes` (a value sets its key,
    None removes it: a JSON merge patch), and {key: why} of the changes refused. Operators may set
    any key, their own value over the agent's too, and remove what they set; what the agent says
    stays its own (its --labels and its GPUs' labels, its --taints), as its next registration
    would say it again. With `taints`, a value may name its effect (`research:NoExecute`)."""
    layer, refused = dict(operator), {}
    for key, value in changes.items():
        if value is None:
            if key in layer:
                del layer[key]
            elif key in agent:
                refused[key] = f"{key}={agent[key]} is its agent's: start the agent without it, or set another value"
            else:
                refused[key] = f"it has no {key}"
        elif problem := pair_problem(key, value, taint=taints):
            refused[key] = problem
        else:
            layer[key] = _stored_taint(value) if taints else value
    if not refused and len(layer) > max(MAX_PAIRS, len(operator)):
        # The operators' own, as an agent's --labels are held to it (its GPUs' come on top).
        refused[next(iter(changes))] = f"at most {MAX_PAIRS} set by operators, and this makes {len(layer)}"
    return layer, refused


# A node as placement's refusals read it: its labels and its taints.
Marks = tuple[Mapping[str, str], Mapping[str, str]]


def refusals(nodes: Mapping[str, Marks], deployment: str, selector: str, tolerations: str) -> dict[str, str]:
    """{node: why} of the nodes a deployment's replicas may not run on: those whose labels do not
    hold every pair of its node selector, or with a NoSchedule or NoExecute taint its tolerations
    do not name (both as a deployment stores them)."""
    wanted, tolerated = parse(selector), parse_tolerations(tolerations)
    refused = {}
    for name, (labels, taints) in nodes.items():
        if not matches(labels, wanted):
            refused[name] = f"its labels do not match {deployment}'s placement.node_selector {selector}"
        elif kept_off := keeping_off(taints, tolerated):
            refused[name] = f"its taint {text(kept_off)} is not in {deployment}'s placement.tolerations"
    return refused


def avoidances(nodes: Mapping[str, Marks], deployment: str, tolerations: str) -> dict[str, str]:
    """{node: why} of the nodes placement puts a deployment's replicas on last (Kubernetes'
    PreferNoSchedule): those with a PreferNoSchedule taint its tolerations do not name. They may
    still be refused (`refusals`): refusal goes first."""
    tolerated = parse_tolerations(tolerations)
    avoided = {}
    for name, (_, taints) in nodes.items():
        if soft := untolerated(taints, tolerated, (PREFER_NO_SCHEDULE,)):
            avoided[name] = f"its taint {text(soft)} is not in {deployment}'s placement.tolerations"
    return avoided
