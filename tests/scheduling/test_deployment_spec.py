"""A deployment's settings are declared once, in gpuportal.wire.deployment_spec: the model's
fields, the services' DeploymentSpec and the columns a PATCH writes, and the API's deploy and PATCH
bodies all follow it, and a PATCH does to each setting what the spec says."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from django.db.models import CASCADE, NOT_PROVIDED
from rest_framework.fields import empty

from gpuportal.wire import deployment_spec
from gpuportal.wire.deployment_spec import SETTINGS, Setting, Update
from scheduling.api.examples import EXAMPLES
from scheduling.api.inputs import DeploymentInput, DeploymentPatch, RefusedField
from scheduling.api.serializers import NOT_SHOWN, DeploymentSerializer
from scheduling.models import Deployment, DeploymentObserved, Event
from scheduling.services.deployments import MUTABLE, DeploymentSpec
from tests.support.deployments import body

MiB = 1024**2
DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"

# The Deployment row's fields that are no operator's setting: its identity alone.
IDENTITY = {"id", "name", "created_at", "updated_at"}
# What the portal measures or decides about a deployment: its observed record's, never the row's.
OBSERVED = {
    "memory_measured_bytes",
    "memory_measured_context_bytes",
    "memory_estimate_bytes",
    "weight_bytes",
    "measured_load_s",
    "measured_wake_s",
    "load_failures",
    "failed_reason",
    "retry_at",
    "restart_since",
    "restart_surge",
    "restart_only",
}

REFUSED = [s for s in SETTINGS if s.update in (Update.REFUSED, Update.REFUSED_IF_CHANGED)]
APPLIED = [s for s in SETTINGS if s.update in (Update.LIVE, Update.NEXT_REPLICA, Update.SCALE)]


def ids(settings: list[Setting]) -> list[str]:
    return [s.path for s in settings]


def test_a_deployments_row_holds_the_specs_settings_and_its_identity_and_nothing_else():
    fields = {field.name for field in Deployment._meta.concrete_fields}
    columns = [s.column for s in SETTINGS]

    assert len(set(columns)) == len(columns), "two settings in one column"
    assert not IDENTITY & set(columns), "a setting named as the deployment's identity"
    assert fields == IDENTITY | set(columns), (
        f"neither a setting in the spec nor identity: {sorted(fields - IDENTITY - set(columns))}; "
        f"not on the model: {sorted(IDENTITY | set(columns) - fields)}"
    )


def test_what_the_portal_measures_or_decides_is_held_by_the_deployments_observed_record():
    fields = {field.name for field in DeploymentObserved._meta.concrete_fields}
    link = DeploymentObserved._meta.get_field("deployment")

    assert fields == {"deployment", *OBSERVED}
    assert link.one_to_one and link.primary_key and link.related_model is Deployment
    assert link.remote_field.on_delete is CASCADE, "it goes with its deployment"
    assert not OBSERVED & {s.column for s in SETTINGS}, "a setting is the operator's, never observed"


def test_the_spec_names_each_setting_once_and_places_it_once_in_the_body():
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)
    assert len({(s.group, s.key) for s in SETTINGS}) == len(SETTINGS)
    assert {s.group for s in SETTINGS} - {""} == set(deployment_spec.GROUPS)
    assert not {s.key for s in SETTINGS if not s.group} & set(deployment_spec.GROUPS)


@pytest.mark.parametrize("setting", SETTINGS, ids=ids(SETTINGS))
def test_the_models_default_and_choices_of_a_setting_are_the_specs(setting):
    field = Deployment._meta.get_field(setting.column)

    if setting.required:
        assert not field.has_default()
    else:
        assert field.get_default() == setting.default
        assert type(field.get_default()) is type(setting.default)
    if field.db_default is not NOT_PROVIDED:
        assert getattr(field.db_default, "value", field.db_default) == setting.default
    if field.choices:
        assert [value for value, _ in field.choices] == list(setting.choices)
    assert field.null == setting.nullable


def test_deployment_spec_has_the_name_and_every_setting_with_its_default():
    fields = dataclasses.fields(DeploymentSpec)

    assert [f.name for f in fields] == ["name", *(s.name for s in SETTINGS)]
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    assert defaults == deployment_spec.defaults()


def test_a_patch_writes_the_columns_of_the_settings_that_change_in_place_and_no_other():
    in_place = {s.name: s.column for s in SETTINGS if s.update in (Update.LIVE, Update.NEXT_REPLICA, Update.ROLLOUT)}
    assert in_place == MUTABLE


def _field_of(fields: dict, setting: Setting):
    return fields[setting.group].fields[setting.key] if setting.group else fields[setting.key]


def test_the_deploy_body_holds_the_specs_settings_in_their_groups_and_nothing_else():
    fields = DeploymentInput().fields

    assert list(fields) == ["name", *dict.fromkeys(s.group or s.key for s in SETTINGS)]
    for group in deployment_spec.GROUPS:
        assert list(fields[group].fields) == [s.key for s in deployment_spec.in_group(group)], group
        assert fields[group].required == any(s.required for s in deployment_spec.in_group(group))


@pytest.mark.parametrize("setting", SETTINGS, ids=ids(SETTINGS))
def test_a_deploy_takes_a_setting_with_the_specs_default_bounds_and_choices(setting):
    field = _field_of(DeploymentInput().fields, setting)

    assert field.required == setting.required
    assert field.default == (empty if setting.required else setting.default)
    assert field.allow_null == setting.nullable
    assert getattr(field, "min_value", None) == setting.min
    assert getattr(field, "max_value", None) == setting.max
    assert getattr(field, "max_length", None) == setting.max_length
    assert list(getattr(field, "choices", {})) == list(setting.choices)
    assert field.help_text == setting.help


def test_an_omitted_setting_gets_the_specs_default():
    data = DeploymentInput(data={"name": "tiny", "model": {"source": "/srv/models/tiny"}})
    assert data.is_valid(), data.errors

    spec = data.to_spec()
    assert dataclasses.asdict(spec) == {"name": "tiny", "source": "/srv/models/tiny", **deployment_spec.defaults()}


def test_a_patch_takes_each_setting_without_a_default_and_a_group_of_refused_ones_not_at_all():
    fields = DeploymentPatch().fields

    assert list(fields) == ["name", *dict.fromkeys(s.group or s.key for s in SETTINGS)]
    for group in deployment_spec.GROUPS:
        settings = deployment_spec.in_group(group)
        if all(s.update == Update.REFUSED for s in settings):
            assert isinstance(fields[group], RefusedField), group
            continue
        assert list(fields[group].fields) == [s.key for s in settings], group
        assert not fields[group].required
    for setting in SETTINGS:
        if isinstance(fields[setting.group or setting.key], RefusedField):
            continue
        field = _field_of(fields, setting)
        assert not field.required and field.default is empty, setting.path


def test_an_answer_shows_every_setting_but_the_ones_named_as_never_shown():
    fields = DeploymentSerializer().fields

    for setting in SETTINGS:
        if not setting.group:
            assert setting.column in fields, setting.path  # by its column: "replicas" lists the replicas
            continue
        shown = fields[setting.group].fields
        assert (setting.key in shown) == (setting.name not in NOT_SHOWN), setting.path
        if setting.key in shown:
            assert shown[setting.key].source == setting.column, setting.path


def test_the_api_docs_example_answer_shows_each_group_as_the_answers_do():
    fields = DeploymentSerializer().fields
    example = EXAMPLES[("get", "/api/deployments/{name}/")]["response"]

    for group in deployment_spec.GROUPS:
        assert list(example[group]) == list(fields[group].fields), group


def test_the_docs_table_of_settings_is_drawn_from_the_spec():
    text = DOCS.read_text()
    drawn = text.partition(deployment_spec.BEGIN)[2].partition(deployment_spec.END)[0]
    assert drawn == deployment_spec.markdown_table(), "run `python -m gpuportal.wire.deployment_spec --write-docs`"


def test_the_docs_show_the_deploy_body_with_every_default():
    text = DOCS.read_text()
    shown = json.loads(re.search(r"## Deployments\n.*?```json\n(.*?)```", text, re.S).group(1))
    expected: dict = {"name": shown["name"]}
    for s in SETTINGS:
        value = shown["model"]["source"] if s.required else s.default
        (expected.setdefault(s.group, {}) if s.group else expected)[s.key] = value
    assert shown == expected


# -- what a PATCH does ----------------------------------------------------------------------------


def other_value(setting: Setting, current: object) -> object:
    """A valid value of the setting other than `current`."""
    if setting.choices:
        return next(choice for choice in setting.choices if choice != current)
    if setting.type is bool:
        return not current
    if setting.check is not None:  # a syntax of its own: a node selector
        return next(value for value in ("gpu=h100", "gpu=a10") if value != current)
    if setting.type is str:
        return f"{current}-elsewhere"
    return min(setting.max or 1e9, (current or setting.min or 0) + 1) if current != setting.max else setting.min


def patch_of(setting: Setting, value: object) -> dict:
    return {setting.group: {setting.key: value}} if setting.group else {setting.key: value}


def names(error: dict, setting: Setting) -> bool:
    """Whether a 400's body names the setting: as `group.key`, nested, or its whole group."""
    return setting.path in error or setting.key in error.get(setting.group, {}) or setting.group in error


@pytest.mark.parametrize("setting", REFUSED, ids=ids(REFUSED))
def test_a_patch_of_a_refused_setting_is_a_400_naming_it_and_applies_nothing(
    cluster, api, dispatched, tiny_model_dir, setting
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    before = Deployment.objects.values().get(name="tiny-a")
    wanted = other_value(setting, before[setting.column])

    response = api("patch", "/api/deployments/tiny-a/", {**patch_of(setting, wanted), "fairness": {"max_wait_s": 9}})

    assert response.status_code == 400, response.json()
    assert names(response.json(), setting), response.json()
    assert "cannot be changed" in json.dumps(response.json())
    after = Deployment.objects.values().get(name="tiny-a")
    assert after == before


@pytest.mark.parametrize(
    "setting", [s for s in SETTINGS if s.update == Update.REFUSED_IF_CHANGED], ids=lambda s: s.path
)
def test_a_patch_may_send_back_the_current_value_of_a_setting_refused_only_if_changed(
    cluster, api, dispatched, tiny_model_dir, setting
):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    current = Deployment.objects.values_list(setting.column, flat=True).get(name="tiny-a")

    response = api("patch", "/api/deployments/tiny-a/", {**patch_of(setting, current), "fairness": {"max_wait_s": 9}})

    assert response.status_code == 200, response.json()
    assert Deployment.objects.get(name="tiny-a").max_wait_s == 9


@pytest.mark.parametrize("setting", APPLIED, ids=ids(APPLIED))
def test_a_patch_of_a_setting_that_may_change_applies_it_at_once(cluster, api, dispatched, tiny_model_dir, setting):
    api("post", "/api/deployments/", body("tiny-a", tiny_model_dir))
    current = Deployment.objects.values_list(setting.column, flat=True).get(name="tiny-a")
    wanted = 512 * MiB if setting.name == "override_bytes" else other_value(setting, current)

    response = api("patch", "/api/deployments/tiny-a/", patch_of(setting, wanted))

    assert response.status_code == 200, response.json()
    assert Deployment.objects.values_list(setting.column, flat=True).get(name="tiny-a") == wanted
    if setting.update != Update.SCALE:
        changed = Event.objects.get(reason__startswith="settings changed", deployment="tiny-a")
        # Running replicas keep what they started with: the Event says so.
        assert ("from now on" in changed.reason) == (setting.update == Update.NEXT_REPLICA), changed.reason
