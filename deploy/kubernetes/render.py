"""Render a kustomization of this directory without kubectl: the subset of kustomize that the base
and the example overlay use, and nothing more. A field it does not know is an error rather than
something left out, so it never renders less than `kubectl kustomize` would;
tests/gpuportal/test_kubernetes.py checks that both give the same objects where kubectl is there.

    python deploy/kubernetes/render.py deploy/kubernetes/overlays/example > gpuportal.yaml

Supported: `resources` (YAML files, and directories holding a kustomization), `namespace`, `labels`
(`pairs`, `includeTemplates`; not `includeSelectors`), `images` (`name`, `newName`, `newTag`,
`digest`) and `patches` given inline as JSON 6902 operations with a `target` of kind and name.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}
# Objects that live outside any namespace (those this project could use): `namespace` leaves them.
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass",
                  "PersistentVolume", "CustomResourceDefinition", "RuntimeClass"}  # fmt: skip
# Kinds whose pod template is at spec.template, as kustomize's label and image transformers see them.
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "ReplicationController"}

Object = dict[str, Any]


class RenderError(ValueError):
    pass


def kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_NAMES:
        if (directory / name).is_file():
            return directory / name
    raise RenderError(f"{directory}: no kustomization.yaml")


def load_objects(path: Path) -> list[Object]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(directory: str | Path) -> list[Object]:
    """The objects the kustomization in `directory` makes, in the order its resources list them."""
    directory = Path(directory)
    spec = yaml.safe_load(kustomization_file(directory).read_text()) or {}
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise RenderError(f"{directory}: kustomization fields this renderer does not support: {sorted(unknown)}")
    objects: list[Object] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        objects += render(path) if path.is_dir() else load_objects(path)
    for patch in spec.get("patches", []):
        apply_patch(objects, patch, directory)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for labels in spec.get("labels", []):
        add_labels(objects, labels, directory)
    for image in spec.get("images", []):
        set_image(objects, image)
    return objects


def add_labels(objects: list[Object], labels: dict, directory: Path) -> None:
    unknown = set(labels) - {"pairs", "includeTemplates", "includeSelectors"}
    if unknown or labels.get("includeSelectors"):
        raise RenderError(f"{directory}: labels with {sorted(unknown) or 'includeSelectors'} are not supported")
    pairs = {key: str(value) for key, value in labels["pairs"].items()}
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)
        if labels.get("includeTemplates") and obj["kind"] in WORKLOADS:
            template = obj["spec"]["template"].setdefault("metadata", {})
            template.setdefault("labels", {}).update(pairs)


def pod_specs(obj: Object) -> list[Object]:
    if obj["kind"] in WORKLOADS:
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    if obj["kind"] == "CronJob":
        return [obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    return []


def split_image(image: str) -> tuple[str, str]:
    """(name, what follows it: ':tag', '@digest' or '')."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def set_image(objects: list[Object], image: dict) -> None:
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise RenderError(f"images: fields this renderer does not support: {sorted(unknown)}")
    for obj in objects:
        for spec in pod_specs(obj):
            for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
                name, rest = split_image(container["image"])
                if name != image["name"]:
                    continue
                if "digest" in image:
                    rest = "@" + image["digest"]
                elif "newTag" in image:
                    rest = ":" + str(image["newTag"])
                container["image"] = image.get("newName", name) + rest


def apply_patch(objects: list[Object], patch: dict, directory: Path) -> None:
    target = patch.get("target") or {}
    if set(patch) != {"target", "patch"} or set(target) - {"kind", "name"}:
        raise RenderError(f"{directory}: only inline patches with a target of kind and name are supported")
    operations = yaml.safe_load(patch["patch"])
    if not isinstance(operations, list):
        raise RenderError(f"{directory}: only JSON 6902 patches (a list of operations) are supported")
    matched = [
        obj
        for obj in objects
        if obj["kind"] == target.get("kind", obj["kind"])
        and obj["metadata"]["name"] == target.get("name", obj["metadata"]["name"])
    ]
    if not matched:
        raise RenderError(f"{directory}: patch target {target} matches no object")
    for obj in matched:
        for operation in operations:
            apply_operation(obj, operation)


def pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} does not start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def apply_operation(document: Object, operation: dict) -> None:
    """One RFC 6902 operation: add, replace or remove (what the overlays use)."""
    op, parts = operation["op"], pointer(operation["path"])
    parent: Any = document
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    value = copy.deepcopy(operation.get("value"))
    if isinstance(parent, list):
        if op == "add":
            parent.insert(len(parent) if last == "-" else int(last), value)
        elif op == "replace":
            parent[int(last)] = value
        elif op == "remove":
            del parent[int(last)]
        else:
            raise RenderError(f"patch operation {op!r} is not supported")
    elif op in ("add", "replace"):
        if op == "replace" and last not in parent:
            raise RenderError(f"replace: {operation['path']} does not exist")
        parent[last] = value
    elif op == "remove":
        del parent[last]
    else:
        raise RenderError(f"patch operation {op!r} is not supported")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: render.py DIRECTORY (a kustomization)", file=sys.stderr)
        return 2
    try:
        objects = render(argv[1])
    except (RenderError, OSError) as err:
        print(f"render.py: {err}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(objects, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
