"""Every setting an operator gives a deployment, each written here once: its name, where it sits
in the REST body (docs/api.md), the model column that stores it, its type, default and bounds, how
a change of it applies, and what it means.

The rest is derived from `SETTINGS`: the services' DeploymentSpec and the columns a PATCH may
write (scheduling.services.deployments), the API's input serializers (scheduling.api.inputs), the
model's defaults (scheduling.models.Deployment), the CLI's deploy flags, the dashboard's deploy
form and the admin's settings form. A test holds the model and those modules to it
(tests/scheduling/test_deployment_spec.py). Django-free, like the rest of the contract, so the CLI
imports it too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gpuportal.wire import adapters, memory, node_labels, prefix_cache


class Loader(StrEnum):
    """What a replica's process loads the model with."""

    TRANSFORMERS = "transformers"
    TORCH_MODULE = "torch-module"
    EMBEDDING = "transformers-embedding"


class DType(StrEnum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Update(StrEnum):
    """What a PATCH of the setting does to an existing deployment."""

    # Stored at once, and the next decision that reads it follows it.
    LIVE = "live"
    # Stored at once; replicas placed (or, for a reservation, woken) from now on follow it,
    # running ones keep what they started with.
    NEXT_REPLICA = "next-replica"
    # Stored at once, and a rolling restart replaces every replica with one that follows it: a
    # running process cannot load other weights, and a deployment keeps its name (its clients,
    # its `/v1` model id) across a new model, as a Kubernetes Deployment keeps its across a new image.
    ROLLOUT = "rollout"
    # Scales the deployment at once: replicas are placed or stopped.
    SCALE = "scale"
    # A PATCH naming it is a 400 naming it: another value is another deployment.
    REFUSED = "refused"
    # Cannot change either, but a PATCH may send the current value back (a client returning
    # what it read gets a 200 that changes nothing); another value is a 400 naming it.
    REFUSED_IF_CHANGED = "refused-if-changed"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


# The default of a setting a deploy must give.
REQUIRED: object = _Required()


@dataclass(frozen=True)
class Setting:
    name: str  # DeploymentSpec's field, and the key of a service's `changes`
    group: str  # its group in the REST body; "" at the top level
    key: str  # its key in the group
    column: str  # the scheduling.models.Deployment field that stores it
    type: type  # bool, int, float or str
    default: object
    update: Update
    help: str
    min: int | float | None = None
    max: int | float | None = None
    # The Django setting holding the maximum, read per request (an operator's setting).
    max_setting: str = ""
    nullable: bool = False
    choices: tuple[str, ...] = ()
    max_length: int | None = None
    # A text setting's own syntax: the value as stored (canonical), or ValueError saying what is
    # wrong. The API's input, the CLI and the admin all call it.
    check: Callable[[str], str] | None = None
    # What `check` allows, for the docs' table.
    rule: str = ""

    @property
    def path(self) -> str:
        """How an error names it: `group.key`, or the key at the top level."""
        return f"{self.group}.{self.key}" if self.group else self.key

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def stored(self) -> bool:
        """Whether a PATCH writes it to its column (the rest scale, or are refused)."""
        return self.update in (Update.LIVE, Update.NEXT_REPLICA, Update.ROLLOUT)


# What PostgreSQL's bigint holds is far above any GPU; 1 PiB is a typo's bound, not a GPU's.
MAX_BYTES = 2**50

# In the order of the REST body.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "source", "model", "source", "model_source", str, REQUIRED, Update.ROLLOUT, max_length=1000,
        help="A model directory on the nodes, hf:org/name (from the nodes' Hugging Face cache, never "
        "downloaded), or package.module:factory (torch-module). Changed, it rolls every replica onto "
        "the new model, one at a time.",
    ),
    Setting(
        "loader", "model", "loader", "loader", str, Loader.TRANSFORMERS.value, Update.REFUSED,
        choices=tuple(Loader),
        help="transformers: a causal LM (text, chat, /v1 completions); transformers-embedding: an encoder "
        "(/v1/embeddings); torch-module: a PyTorch module (JSON tensors).",
    ),
    Setting(
        "dtype", "model", "dtype", "dtype", str, DType.FLOAT32.value, Update.ROLLOUT, choices=tuple(DType),
        help="The dtype the weights are loaded in.",
    ),
    Setting(
        "adapters", "model", "adapters", "model_adapters", str, "", Update.ROLLOUT,
        max_length=adapters.MAX_TEXT, check=adapters.canonical, rule=adapters.RULE,
        help="name=source,... : PEFT LoRA adapters of the model, each a directory on the nodes or hf:org/name, "
        "served beside it under the model id deployment:name (transformers loader, Llama-style models). "
        "Changed, it rolls every replica onto the new set.",
    ),
    Setting(
        "replicas", "", "replicas", "replicas_wanted", int, 1, Update.SCALE, min=0,
        max_setting="GPUPORTAL_MAX_REPLICAS",
        help="How many replicas to keep, sleeping ones counted; at most GPUPORTAL_MAX_REPLICAS.",
    ),
    Setting(
        "dedicated", "", "dedicated", "dedicated", bool, False, Update.LIVE,
        help="Its replicas are never evicted to make room for others.",
    ),
    Setting(
        "override_bytes", "memory", "override_bytes", "memory_override_bytes", int, None, Update.NEXT_REPLICA,
        min=1, max=MAX_BYTES, nullable=True,
        help="Reserve this much per replica instead of the estimate or the measurement.",
    ),
    Setting(
        "max_tokens", "memory", "max_tokens", "max_tokens", int, 2048, Update.NEXT_REPLICA, min=1, max=1_048_576,
        help="The longest sequence (prompt and output) a replica serves; its KV cache is sized for it.",
    ),
    Setting(
        "prefix_cache", "memory", "prefix_cache", "prefix_cache", str, prefix_cache.USER, Update.ROLLOUT,
        choices=prefix_cache.MODES,
        help="user (default): a replica keeps the KV cache of the prompts it computed, and a prompt that begins "
        "alike reuses it, among one user's requests only; shared: among every user's (one system prompt for a "
        "team); off: each prompt computed whole. Changed, it rolls every replica.",
    ),
    Setting(
        "memory_policy", "memory", "policy", "memory_policy", str, "gpuportal", Update.REFUSED,
        choices=tuple(memory.POLICIES),
        help="gpuportal, or ndif (model size × 3, for comparison).",
    ),
    Setting(
        "min_runtime_s", "fairness", "min_runtime_s", "min_runtime_s", float, 10.0, Update.LIVE,
        min=0, max=86_400,
        help="A replica serves at least this long before it may be preempted.",
    ),
    Setting(
        "max_wait_s", "fairness", "max_wait_s", "max_wait_s", float, 5.0, Update.LIVE, min=0, max=3_600,
        help="A wake waits up to this long for memory to be freed before it preempts anyone.",
    ),
    Setting(
        "popular", "fairness", "popular", "popular", bool, False, Update.LIVE,
        help="Never preempted and never put to sleep when idle.",
    ),
    Setting(
        "idle_timeout_s", "sleep", "idle_timeout_s", "idle_timeout_s", float, 300.0, Update.LIVE,
        min=0, max=30 * 86_400,
        help="A replica idle this long is put to sleep (0: never).",
    ),
    Setting(
        "deep_after_s", "sleep", "deep_after_s", "deep_sleep_after_s", float, 0.0, Update.LIVE,
        min=0, max=30 * 86_400,
        help="A replica asleep this long sleeps deeply: its process exits and it holds no GPU memory, "
        "its weights waiting in its node's host memory for the next wake (0: never).",
    ),
    Setting(
        "drain_timeout_s", "sleep", "drain_timeout_s", "drain_timeout_s", float, 30.0, Update.LIVE,
        min=0, max=3_600,
        help="How long a replica going to sleep or stopping may finish the requests it holds.",
    ),
    Setting(
        "max_load_failures", "restart", "max_load_failures", "max_load_failures", int, 3, Update.LIVE,
        min=1, max=100,
        help="After this many failed loads in a row the deployment is failed until retried or changed.",
    ),
    Setting(
        "backoff_s", "restart", "backoff_s", "load_backoff_s", float, 5.0, Update.LIVE, min=0, max=3_600,
        help="A failed load is replaced after this long, doubling per failure in a row.",
    ),
    Setting(
        "backoff_max_s", "restart", "backoff_max_s", "load_backoff_max_s", float, 300.0, Update.LIVE,
        min=0, max=86_400,
        help="The longest wait before a failed load is replaced.",
    ),
    Setting(
        "standby", "failover", "standby", "failover_standby", bool, False, Update.REFUSED_IF_CHANGED,
        help="Run each replica as a failover pair: an active replica and a standby on the same GPUs.",
    ),
    Setting(
        "spread", "placement", "spread", "placement_spread", bool, False, Update.NEXT_REPLICA,
        help="false (default): pack replicas onto the fullest GPU that fits, keeping whole GPUs free for "
        "large replicas. true: prefer the GPUs and nodes with the fewest of this deployment's "
        "replicas, then the emptiest GPU.",
    ),
    Setting(
        "node_selector", "placement", "node_selector", "placement_node_selector", str, "", Update.NEXT_REPLICA,
        max_length=node_labels.MAX_TEXT, check=node_labels.canonical, rule="`key=value,...` (node labels)",
        help="key=value,... : its replicas go only to nodes whose labels (their agents' --labels, "
        "`gpuportal node label`) hold "
        "every pair, as a Kubernetes nodeSelector; empty (default): any node. `gpuportal restart` moves "
        "running replicas.",
    ),
    Setting(
        "tolerations", "placement", "tolerations", "placement_tolerations", str, "", Update.NEXT_REPLICA,
        max_length=node_labels.MAX_TEXT, check=node_labels.canonical_tolerations,
        rule="`key=value,...` (node taints; a bare key for any value)",
        help="key=value,... : the node taints (their agents' --taints, `gpuportal node taint`) its replicas "
        "may go past; a bare key, any value of that taint. A node with a taint not named here takes none "
        "of them. Empty (default): only untainted nodes.",
    ),
    Setting(
        "autoscale_max_replicas", "autoscale", "max_replicas", "autoscale_max_replicas", int, 0, Update.LIVE,
        min=0, max_setting="GPUPORTAL_MAX_REPLICAS",
        help="Scale replicas by load between min_replicas and this many (0: off, replicas stays as set). "
        "The autoscaler writes replicas, as an operator's scale would.",
    ),
    Setting(
        "autoscale_min_replicas", "autoscale", "min_replicas", "autoscale_min_replicas", int, 1, Update.LIVE,
        min=1, max_setting="GPUPORTAL_MAX_REPLICAS",
        help="The fewest replicas the autoscaler keeps (sleeping ones counted); at most max_replicas.",
    ),
    Setting(
        "autoscale_target_in_flight", "autoscale", "target_in_flight", "autoscale_target_in_flight", float, 4.0,
        Update.LIVE, min=0.1, max=10_000,
        help="The requests in flight (queued or running) per replica the autoscaler aims at.",
    ),
    Setting(
        "autoscale_down_after_s", "autoscale", "down_after_s", "autoscale_down_after_s", float, 300.0, Update.LIVE,
        min=0, max=86_400,
        help="A replica is stopped only once the load has wanted fewer for this long (a scale-up is at once).",
    ),
)  # fmt: skip

BY_NAME: Mapping[str, Setting] = {setting.name: setting for setting in SETTINGS}
# By its place in the REST body (`sleep.idle_timeout_s`), as errors and the history name it.
BY_PATH: Mapping[str, Setting] = {setting.path: setting for setting in SETTINGS}

# What each group is about, in the order of the REST body (the top level's settings among them).
GROUPS: Mapping[str, str] = {
    "model": "The model: a new source, dtype or set of adapters rolls every replica onto it; another loader is "
    "another deployment.",
    "memory": "What a replica reserves, and how the need is reckoned.",
    "fairness": "Who may preempt whom, and when.",
    "sleep": "When replicas sleep, when they sleep deeply, and how long they drain.",
    "restart": "Crash-loop backoff: a failed load is replaced after backoff_s, doubling up to backoff_max_s; "
    "after max_load_failures in a row the deployment is failed until retried or changed.",
    "failover": "Failover pairs.",
    "placement": "Where replicas go.",
    "autoscale": "Replicas by load: between min_replicas and max_replicas, target_in_flight requests each.",
}


def adapters_problem(values: Mapping[str, object]) -> tuple[str, str] | None:
    """LoRA adapters beside a model that takes none (an encoder, a torch module), as (path, message)."""
    loader = values.get("loader")
    if values.get("adapters") and loader != Loader.TRANSFORMERS:
        return "model.adapters", f"LoRA adapters are served beside a causal LM (loader transformers), not a {loader}"
    return None


def autoscale_problem(values: Mapping[str, object], changed: Collection[str] = ()) -> tuple[str, str] | None:
    """What is wrong across the autoscale settings (`values` by name), as (path, message), naming
    the one of them a PATCH changed (`changed`); None when fine. Each alone is held to its bounds
    elsewhere."""
    most, least = values["autoscale_max_replicas"], values["autoscale_min_replicas"]
    if not (isinstance(most, int) and isinstance(least, int) and most and least > most):
        return None
    if "autoscale_max_replicas" in changed and "autoscale_min_replicas" not in changed:
        return "autoscale.max_replicas", f"must be 0 (off) or at least autoscale.min_replicas ({least}), got {most}"
    return "autoscale.min_replicas", f"must be at most autoscale.max_replicas ({most}), got {least}"


def in_group(group: str) -> tuple[Setting, ...]:
    return tuple(setting for setting in SETTINGS if setting.group == group)


def defaults() -> dict[str, object]:
    """Every optional setting's default, by name."""
    return {setting.name: setting.default for setting in SETTINGS if not setting.required}


# -- the docs' table ------------------------------------------------------------------------------

_PATCHED = {
    Update.LIVE: "applies at once",
    Update.NEXT_REPLICA: "applies to replicas placed from now on",
    Update.ROLLOUT: "rolls every replica onto it, one at a time, by a rolling restart",
    Update.SCALE: "scales at once",
    Update.REFUSED: "refused (a 400 naming it)",
    Update.REFUSED_IF_CHANGED: "refused (a 400 naming it) unless it is the current value",
}


def patch_effect(setting: Setting) -> str:
    """What a PATCH of the setting does, in a few words ("applies at once", ...)."""
    return _PATCHED[setting.update]


def by_key(key: str) -> Setting | None:
    """The setting whose REST key is `key` alone (`idle_timeout_s` for `sleep.idle_timeout_s`),
    where no other group has that key; None otherwise."""
    found = [setting for setting in SETTINGS if setting.key == key]
    return found[0] if len(found) == 1 else None


def _shown(value: object) -> str:
    if value is REQUIRED:
        return "required"
    if isinstance(value, bool) or value is None:
        return f"`{json.dumps(value)}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int) and value > 2**20 and value.bit_count() == 1:
        return f"`{value}` (2^{value.bit_length() - 1})"
    return f"`{value}`"


def _allowed(setting: Setting) -> str:
    if setting.choices:
        named = [f"`{choice}`" for choice in setting.choices]
        allowed = ", ".join(named[:-1]) + f" or {named[-1]}"
    elif setting.type is bool:
        allowed = "`true` or `false`"
    elif setting.rule:
        allowed = setting.rule
    elif setting.max_length is not None:
        allowed = f"up to {setting.max_length} characters"
    else:
        most = f"`{setting.max_setting}`" if setting.max_setting else _shown(setting.max)
        allowed = f"{_shown(setting.min)} to {most}"
    return allowed + (", or `null`" if setting.nullable else "")


def markdown_table() -> str:
    """Every setting's default, what it allows and what a PATCH does to it: docs/api.md holds it."""
    lines = ["| setting | default | allowed | a PATCH |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        lines.append(f"| `{s.path}` | {_shown(s.default)} | {_allowed(s)} | {_PATCHED[s.update]} |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- deployment-settings:begin -->\n", "<!-- deployment-settings:end -->"


def write_docs(path: Path) -> None:
    """Put the table between the deployment-settings markers of `path` (docs/api.md)."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no deployment-settings markers to put the table between")
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}{markdown_table()}{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        write_docs(Path(__file__).resolve().parents[2] / "docs" / "api.md")
    else:
        print(markdown_table(), end="")
