"""A node's labels and taints and a deployment's node selector and tolerations, as Kubernetes has
them for pods: an agent declares what its host is (`--labels gpu=h100,zone=b`,
GPUPORTAL_NODE_LABELS), its GPUs say what they are (`gpu_labels`, named as NVIDIA's GPU feature
discovery names them on Kubernetes), and a deployment's `placement.node_selector` (`gpu=h100`)
keeps its replicas on the nodes whose labels hold every pair it names. The other way round, an
agent's taints (`--taints team=research`, GPUPORTAL_NODE_TAINTS) keep every deployment off its node
but those whose `placement.tolerations` name each of them (Kubernetes' NoSchedule: what runs there
already stays). All are written `key=value,key=value`. Django-free: the agent, the CLI, the API's
input and placement read the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

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


def parse(text: str) -> dict[str, str]:
    """`key=value,key=value` as a mapping ("" is none); ValueError naming what is wrong."""
    if len(text) > MAX_TEXT:
        raise ValueError(f"at most {MAX_TEXT} characters, got {len(text)}")
    pairs: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, equals, value = (side.strip() for side in item.partition("="))
        if not equals:
            raise ValueError(f"{item!r} is not key=value ({RULE})")
        if problem := pair_problem(key, value):
            raise ValueError(problem)
        if key in pairs and pairs[key] != value:
            raise ValueError(f"{key} given twice ({pairs[key]} and {value})")
        pairs[key] = value
    if len(pairs) > MAX_PAIRS:
        raise ValueError(f"at most {MAX_PAIRS} pairs, got {len(pairs)}")
    return pairs


def pair_problem(key: object, value: object) -> str | None:
    """What is wrong with one pair, or None."""
    if not isinstance(key, str) or not KEY.fullmatch(key):
        return f"{key!r} is no label key ({RULE})"
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
    for key, value in labels.items():
        if problem := pair_problem(key, value):
            raise ValueError(problem)
    return dict(labels)


def text(pairs: Mapping[str, str]) -> str:
    """The canonical `key=value,...`, keys sorted: what a deployment stores and shows."""
    return ",".join(f"{key}={pairs[key]}" for key in sorted(pairs))


def canonical(selector: str) -> str:
    """A node selector or tolerations as a deployment stores them (keys sorted, spaces gone);
    ValueError if bad. The spec's check of `placement.node_selector` and `placement.tolerations`."""
    return text(parse(selector))


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


def untolerated(taints: Mapping[str, str], tolerations: Mapping[str, str]) -> dict[str, str]:
    """The taints of a node that `tolerations` do not name, pair for pair: none, and it may run there."""
    return {key: value for key, value in taints.items() if tolerations.get(key) != value}


# A node as placement's refusals read it: its labels and its taints.
Marks = tuple[Mapping[str, str], Mapping[str, str]]


def refusals(nodes: Mapping[str, Marks], deployment: str, selector: str, tolerations: str) -> dict[str, str]:
    """{node: why} of the nodes a deployment's replicas may not run on: those whose labels do not
    hold every pair of its node selector, or with a taint its tolerations do not name (both as
    a deployment stores them)."""
    wanted, tolerated = parse(selector), parse(tolerations)
    refused = {}
    for name, (labels, taints) in nodes.items():
        if not matches(labels, wanted):
            refused[name] = f"its labels do not match {deployment}'s placement.node_selector {selector}"
        elif untolerated_ := untolerated(taints, tolerated):
            refused[name] = f"its taint {text(untolerated_)} is not in {deployment}'s placement.tolerations"
    return refused
