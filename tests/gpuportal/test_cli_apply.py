"""`gpuportal apply -f FILE`: deployments declared in YAML or JSON, deployed where the portal lacks
them and changed where they differ, as `kubectl apply`; `gpuportal ls NAME -o yaml` read back."""

from __future__ import annotations

import json

import pytest
import yaml

from gpuportal.cli.applying import differing, read_all
from gpuportal.cli.client import CliError
from scheduling.models import Deployment

FLEET = """
# two deployments, the second in a list of a second document
name: chat
model:
  source: /srv/models/chat
sleep:
  idle_timeout_s: 120
---
- name: coder
  model: {source: /srv/models/coder, dtype: bfloat16}
  replicas: 2
  fairness: {popular: true}
  placement: {node_selector: "gpu=h100"}
"""


def test_a_file_declares_deployments_in_the_rest_bodys_shape_as_yaml_or_json():
    chat, coder = read_all(FLEET, "fleet.yaml")

    assert (chat.name, chat.settings) == ("chat", {"source": "/srv/models/chat", "idle_timeout_s": 120.0})
    assert chat.where == "fleet.yaml: document 1 (chat)"
    assert coder.body() == {
        "name": "coder",
        "model": {"source": "/srv/models/coder", "dtype": "bfloat16"},
        "replicas": 2,
        "fairness": {"popular": True},
        "placement": {"node_selector": "gpu=h100"},
    }
    assert [d.name for d in read_all(json.dumps([{"name": "a", "model": {"source": "/m"}}]), "a.json")] == ["a"]


def test_a_deployment_as_ls_prints_it_is_read_back_as_its_settings():
    from scheduling.api.examples import DEPLOYMENT_SHOWN

    # As the API sends it: JSON's types (the example's states are enums).
    answer = json.loads(json.dumps({**DEPLOYMENT_SHOWN, "replicas_wanted": 3}))
    (read,) = read_all(yaml.safe_dump(answer), "tiny-a.yaml")

    # What the answer shows beside the settings (status, its replicas listed, the memory measured)
    # is skipped; the count it wants is the replica count.
    assert read.settings["replicas"] == 3
    assert read.settings["source"] == DEPLOYMENT_SHOWN["model"]["source"]
    assert read.settings["max_tokens"] == 512 and "need_bytes" not in str(read.settings)
    assert differing(read, answer) == [], "what it was read from matches it"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("name: [x\n", "apply: f.yaml is not YAML or JSON: line 2, column 1: expected ',' or ']'"),
        ("", "apply: f.yaml declares no deployment"),
        ("- 3\n", "apply: f.yaml: item 1: a deployment is a mapping (name, model, ...), not a number"),
        ("model: {source: /m}\n", "apply: f.yaml: every deployment needs a name"),
        ("name: a\n", "apply: f.yaml (a): model.source is required"),
        (
            "name: a\nmodel: {source: /m}\nsleep: {idle_timout_s: 3}\n",
            "apply: f.yaml (a): no setting sleep.idle_timout_s; did you mean sleep.idle_timeout_s",
        ),
        ("name: a\nmodel: {source: /m}\nreplica: 2\n", "apply: f.yaml (a): no setting replica; did you mean replicas"),
        ("name: a\nmodel: {source: /m}\nreplicas: two\n", "apply: f.yaml (a): replicas is a whole number, not 'two'"),
        ("name: a\nmodel: {source: /m}\nreplicas: true\n", "apply: f.yaml (a): replicas is a whole number, not True"),
        ("name: a\nmodel: {source: /m}\ndedicated: 1\n", "apply: f.yaml (a): dedicated is true or false, not 1"),
        (
            "name: a\nmodel: {source: /m}\nsleep: {idle_timeout_s: .nan}\n",
            "apply: f.yaml (a): sleep.idle_timeout_s is a number, not nan",
        ),
        ("name: a\nmodel: {source: /m, dtype: fp8}\n", "apply: f.yaml (a): model.dtype is one of float32"),
        (
            "name: a\nmodel: {source: /m}\nsleep: 3\n",
            "apply: f.yaml (a): sleep is a mapping of its settings, not a number",
        ),
        ("name: a\nmodel: {source: /m}\nreplicas: null\n", "apply: f.yaml (a): replicas cannot be null"),
        (
            "name: a\nmodel: {source: /m}\nplacement: {node_selector: 'gpu h100'}\n",
            "apply: f.yaml (a): placement.node_selector: ",
        ),
        (
            "name: a\nmodel: {source: /m}\n---\nname: a\nmodel: {source: /n}\n",
            "apply: a is declared twice (f.yaml: document 1 (a), f.yaml: document 2 (a))",
        ),
    ],
)
def test_what_no_deployment_can_be_is_a_one_line_error_naming_where_before_anything_is_sent(text, error):
    with pytest.raises(CliError) as refused:
        read_all(text, "f.yaml")
    assert str(refused.value).startswith(error), str(refused.value)


@pytest.mark.django_db(transaction=True)
def test_apply_deploys_what_is_missing_changes_what_differs_and_leaves_the_rest(
    cluster, live_server, capsys, dispatched, tiny_model_dir, tmp_path
):
    from tests.support.cli import staff_cli

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"name: chat\nmodel: {{source: {tiny_model_dir}}}\nmemory: {{max_tokens: 256}}\n---\n"
        f"name: coder\nmodel: {{source: {tiny_model_dir}}}\nmemory: {{max_tokens: 256}}\n"
    )
    cli = staff_cli(live_server, capsys)

    def run() -> tuple[int, str, str]:
        return cli("apply", "-f", str(fleet))

    assert run() == (0, "chat: deployed, 1 replica(s)\ncoder: deployed, 1 replica(s)", "")
    assert run() == (0, "chat: unchanged\ncoder: unchanged", "")

    # Read back as ls prints it, changed, applied: only what differs is sent.
    code, shown, _ = cli("ls", "coder", "-o", "yaml")
    assert code == 0
    coder = yaml.safe_load(shown)
    coder["sleep"]["idle_timeout_s"] = 45
    coder["replicas_wanted"] = 2
    fleet.write_text(yaml.safe_dump(coder))
    said = "replicas 1 → 2 (scales at once); sleep.idle_timeout_s 300 → 45 (applies at once)"
    dry = "dry run: nothing was sent that changes anything"
    assert cli("apply", "-f", str(fleet), "--dry-run") == (0, f"coder: would change {said}", dry)
    assert Deployment.objects.get(name="coder").replicas_wanted == 1, "a dry run changes nothing"
    assert run() == (0, f"coder: {said}", "")
    deployment = Deployment.objects.get(name="coder")
    assert (deployment.replicas_wanted, deployment.idle_timeout_s, deployment.max_tokens) == (2, 45.0, 256)

    # A deployment the API refuses stops the apply there, saying what was applied before it.
    fleet.write_text(
        f"name: chat\nmodel: {{source: {tiny_model_dir}}}\nsleep: {{idle_timeout_s: 60}}\n---\n"
        "name: broken\nmodel: {source: /no/such/model}\n---\n"
        f"name: after\nmodel: {{source: {tiny_model_dir}}}\n"
    )
    code, out, err = run()
    assert code == 1 and out == "chat: sleep.idle_timeout_s 300 → 60 (applies at once)"
    assert err.startswith("error: model.source: ") and err.endswith(
        "(applied before it: chat; not broken and what follows)"
    ), err
    assert not Deployment.objects.filter(name__in=["broken", "after"]).exists()

    # A dry run of what the portal lacks deploys nothing, and cannot also wait.
    fleet.write_text(f"name: later\nmodel: {{source: {tiny_model_dir}}}\nreplicas: 2\n")
    assert cli("apply", "-f", str(fleet), "--dry-run") == (0, "later: would be deployed, 2 replica(s)", dry)
    assert not Deployment.objects.filter(name="later").exists()
    with pytest.raises(SystemExit) as usage:
        cli("apply", "-f", str(fleet), "--dry-run", "--wait")
    assert usage.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

    # A mistyped file changes nothing: it is read whole before the first call.
    fleet.write_text(f"name: chat\nmodel: {{source: {tiny_model_dir}}}\nsleep: {{idle_timeout_s: 5}}\n---\nname: x\n")
    assert run() == (1, "", "error: apply: " + f"{fleet}: document 2 (x): model.source is required")
    assert Deployment.objects.get(name="chat").idle_timeout_s == 60.0


@pytest.mark.django_db(transaction=True)
def test_apply_with_prune_deletes_what_the_file_leaves_out_once_all_it_declares_is_applied(
    cluster, live_server, capsys, dispatched, tiny_model_dir, tmp_path
):
    from tests.support.cli import staff_cli

    def declared(name: str, extra: str = "") -> str:
        return f"name: {name}\nmodel: {{source: {tiny_model_dir}}}\nmemory: {{max_tokens: 256}}\n{extra}---\n"

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(declared("chat") + declared("coder") + declared("old"))
    cli = staff_cli(live_server, capsys)
    assert cli("apply", "-f", str(fleet), "--prune")[0] == 0
    assert set(Deployment.objects.values_list("name", flat=True)) == {"chat", "coder", "old"}

    fleet.write_text(declared("chat", "sleep: {idle_timeout_s: 60}\n") + declared("coder"))
    changed = "sleep.idle_timeout_s 300 → 60 (applies at once)"
    assert cli("apply", "-f", str(fleet), "--prune", "--dry-run") == (
        0,
        f"chat: would change {changed}\ncoder: unchanged\nold: would be deleted (not in {fleet})",
        "dry run: nothing was sent that changes anything",
    )
    assert Deployment.objects.filter(name="old").exists(), "a dry run deletes nothing"
    # Without --prune what the file leaves out stays.
    assert cli("apply", "-f", str(fleet)) == (0, f"chat: {changed}\ncoder: unchanged", "")
    assert Deployment.objects.filter(name="old").exists()

    assert cli("apply", "-f", str(fleet), "--prune") == (
        0,
        "chat: unchanged\ncoder: unchanged\n"
        f"old: deleted (not in {fleet}): its replicas stop and their memory is released",
        "",
    )
    assert set(Deployment.objects.values_list("name", flat=True)) == {"chat", "coder"}

    # A file the portal refuses part of deletes nothing: the prune comes only after all is applied.
    fleet.write_text(declared("chat") + "name: broken\nmodel: {source: /no/such/model}\n")
    code, _, err = cli("apply", "-f", str(fleet), "--prune")
    assert code == 1 and err.endswith("(applied before it: chat; not broken and what follows)"), err
    assert set(Deployment.objects.values_list("name", flat=True)) == {"chat", "coder"}
