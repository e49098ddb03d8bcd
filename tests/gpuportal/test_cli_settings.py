"""Deployment settings by name on the command line: `gpuportal set NAME SETTING=VALUE ...`,
`gpuportal set NAME` to show them, and `gpuportal deploy ... --set SETTING=VALUE`."""

from __future__ import annotations

import pytest

from gpuportal.cli import app
from gpuportal.cli.client import CliError
from gpuportal.cli.setting_values import MISSING, body_of, current, parse_assignments
from gpuportal.wire import deployment_spec as spec
from scheduling.models import Deployment


def parsed(*items: str, changing: bool = True) -> dict[str, object]:
    return {a.setting.path: a.value for a in parse_assignments(items, "set", changing=changing)}


def test_a_setting_is_named_by_its_place_in_the_body_or_by_its_key_alone_and_read_as_its_type():
    assert parsed(
        "sleep.idle_timeout_s=60",
        "popular=yes",
        "replicas=3",
        "memory.override_bytes=null",
        "placement.spread=FALSE",
        "autoscale.target_in_flight=2.5",
    ) == {
        "sleep.idle_timeout_s": 60.0,
        "fairness.popular": True,
        "replicas": 3,
        "memory.override_bytes": None,
        "placement.spread": False,
        "autoscale.target_in_flight": 2.5,
    }
    assert parsed("model.dtype=bfloat16", changing=False) == {"model.dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("items", "error"),
    [
        (["idle_timeout=60"], "set: no setting 'idle_timeout'; did you mean sleep.idle_timeout_s?"),
        (["sleep.idle_timeout_s"], "set: expected SETTING=VALUE, got 'sleep.idle_timeout_s'"),
        (["=3"], "set: expected SETTING=VALUE, got '=3'"),
        (["popular=true", "fairness.popular=false"], "set: fairness.popular given twice"),
        (["popular=maybe"], "set: fairness.popular is true or false, not 'maybe'"),
        (["replicas=two"], "set: replicas is a whole number, not 'two'"),
        (["sleep.idle_timeout_s=nan"], "set: sleep.idle_timeout_s is a number, not 'nan'"),
        (["replicas=null"], "set: replicas is a whole number, not 'null'"),
        (
            ["model.loader=torch-module"],
            "set: model.loader cannot change: another loader or policy is another deployment",
        ),
        (["memory.policy=ndif"], "set: memory.policy cannot change"),
    ],
)
def test_what_cannot_be_a_setting_is_a_one_line_error_before_anything_is_sent(items, error):
    with pytest.raises(CliError) as refused:
        parse_assignments(items, "set", changing=True)
    assert str(refused.value).startswith(error)


def test_a_choice_is_one_of_the_specs_choices():
    with pytest.raises(CliError, match=r"^deploy: model.dtype is one of float32, float16, bfloat16, not 'int8'$"):
        parse_assignments(["model.dtype=int8"], "deploy", changing=False)


def test_every_setting_goes_to_its_group_in_the_body_and_is_read_back_from_an_answer_where_it_shows():
    values = {s.name: s.default if not s.required else "x" for s in spec.SETTINGS}
    body = body_of((s, values[s.name]) for s in spec.SETTINGS)

    assert body["sleep"]["idle_timeout_s"] == 300.0 and body["replicas"] == 1 and body["dedicated"] is False
    # The answer shows the replica count as replicas_wanted ("replicas" lists the replicas).
    answer = {**body, "replicas": [], "replicas_wanted": 1}
    for setting in spec.SETTINGS:
        assert current(answer, setting) == values[setting.name], setting.path
    assert current({"name": "tiny"}, spec.BY_NAME["idle_timeout_s"]) is MISSING


def test_deploy_takes_any_setting_with_set_beside_its_own_flags_but_not_one_twice(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    monkeypatch.chdir(tmp_path)
    parser = app.build_parser()

    args = parser.parse_args(
        ["deploy", "a", "./tiny", "--max-tokens", "512", "--set", "failover.standby=true", "--set", "idle_timeout_s=60"]
    )
    assert app.deploy_body(args) == {
        "name": "a",
        "model": {"source": str(tmp_path / "tiny")},
        "replicas": 1,
        "memory": {"max_tokens": 512},
        "failover": {"standby": True},
        "sleep": {"idle_timeout_s": 60.0},
    }
    assert app.deploy_body(parser.parse_args(["deploy", "b", "./tiny", "--set", "replicas=3"]))["replicas"] == 3

    for argv, flag in (
        (["--replicas", "2", "--set", "replicas=3"], "--replicas"),
        (["--max-tokens", "2", "--set", "memory.max_tokens=3"], "--max-tokens"),
        (["--set", "model.source=/x"], "SOURCE"),
    ):
        with pytest.raises(CliError, match=rf"^deploy: .+ is given by {flag}: not by --set too$"):
            app.deploy_body(parser.parse_args(["deploy", "c", "./tiny", *argv]))


@pytest.mark.django_db(transaction=True)
def test_set_changes_settings_through_the_api_saying_each_change_and_shows_them_all(live_server, capsys):
    from tests.support import factories as f
    from tests.support.cli import staff_cli

    f.deployment("tiny-a")
    run = staff_cli(live_server, capsys, "set", "tiny-a")

    assert run("sleep.idle_timeout_s=60", "popular=true", "deep_after_s=600") == (
        0,
        "tiny-a: sleep.idle_timeout_s 300 → 60 (applies at once); fairness.popular false → true (applies at once); "
        "sleep.deep_after_s 0 → 600 (applies at once)",
        "",
    )
    deployment = Deployment.objects.get(name="tiny-a")
    assert (deployment.idle_timeout_s, deployment.popular, deployment.deep_sleep_after_s) == (60, True, 600)
    assert run("idle_timeout_s=60") == (0, "tiny-a: sleep.idle_timeout_s 60 (unchanged)", "")

    # Out of bounds: the API's 400 names it, and nothing of the call is applied.
    assert run("popular=false", "sleep.idle_timeout_s=-1") == (
        1,
        "",
        "error: sleep.idle_timeout_s: Ensure this value is greater than or equal to 0.",
    )
    assert Deployment.objects.get(name="tiny-a").popular is True

    code, shown, _ = run()
    lines = shown.splitlines()
    assert code == 0 and "sleep.idle_timeout_s=60" in lines and "fairness.popular=true" in lines
    # Every setting the answers show, one a line, in the spec's order.
    assert [line.partition("=")[0] for line in lines] == [s.path for s in spec.SETTINGS if s.name != "memory_policy"]


@pytest.mark.django_db(transaction=True)
def test_set_of_a_new_model_rolls_it_onto_the_replicas_and_says_so(
    cluster, live_server, capsys, dispatched, tiny_model_dir
):
    from tests.support.cli import staff_cli
    from tests.support.deployments import deploy

    deploy("tiny-a")
    run = staff_cli(live_server, capsys, "set", "tiny-a")

    code, out, err = run(f"source={tiny_model_dir}", "--no-wait")

    assert code == 0, err
    assert out.splitlines()[0] == (
        f"tiny-a: model.source /srv/models/tiny → {tiny_model_dir} "
        "(rolls every replica onto it, one at a time, by a rolling restart)"
    )
    assert "tiny-a: rolling every replica onto the new model, one at a time" in err
    assert Deployment.objects.get(name="tiny-a").model_source == str(tiny_model_dir)
    assert Deployment.objects.get(name="tiny-a").observed.restart_since is not None, "its surge loads"


@pytest.mark.django_db(transaction=True)
def test_set_of_a_new_model_whose_rollout_stops_says_why_and_that_the_model_is_set(
    cluster, live_server, capsys, dispatched, tiny_model_dir
):
    from scheduling.services.deployments import DeploymentSpec, ModelFacts, create
    from scheduling.services.reports import report
    from tests.support.cli import staff_cli

    # Four replicas fill the four 1 GiB GPUs, and the deployment wants a fifth: no room for it.
    spec = DeploymentSpec(name="full", source="/srv/models/tiny", replicas=4, override_bytes=900 * 1024**2)
    for replica in create(spec, facts=ModelFacts(weight_bytes=2**20, estimate_bytes=2**20)).replicas.all():
        report(replica.id, {"event": "serving", "pid": 1, "weights_bytes": 2**20})
    Deployment.objects.filter(name="full").update(replicas_wanted=5)

    code, _, err = staff_cli(live_server, capsys, "set", "full")(f"source={tiny_model_dir}", "--timeout", "30")

    assert code == 1
    last = err.splitlines()[-1]
    assert last.startswith("error: full: rolling restart stopped: no room to place what the deployment lacks"), err
    assert last.endswith("; the new model is set, and `gpuportal restart full` rolls it out")
    assert Deployment.objects.get(name="full").model_source == str(tiny_model_dir)
