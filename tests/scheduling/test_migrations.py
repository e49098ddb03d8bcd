"""The models and their migrations agree, so a clean checkout migrates to the state the code expects."""

from datetime import UTC, datetime

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from scheduling import ledger


@pytest.mark.django_db
def test_no_model_change_is_missing_a_migration():
    # --check exits non-zero (SystemExit) when makemigrations would write a migration.
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db
@pytest.mark.parametrize("function", sorted(ledger.SQL_FUNCTIONS))
def test_the_live_ledger_function_is_the_one_in_its_sql_file(function):
    # The ledger's SQL is read in scheduling/sql/, not only inside migrations; a file
    # edited without a migration (or a migration without its file) shows here.
    text = (ledger.SQL_DIR / ledger.SQL_FUNCTIONS[function]).read_text()
    head, body = text.split("$fn$")[:2]
    settings_in_file = sorted(
        line.strip()[len("SET ") :].replace(" = ", "=") for line in head.splitlines() if line.startswith("SET ")
    )
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc, proconfig FROM pg_proc WHERE proname = %s", [function])
        [(live_body, live_settings)] = cursor.fetchall()
    assert live_body == body
    assert sorted(live_settings or []) == settings_in_file


MOVED = {
    "memory_measured_bytes": 5 * 1024**3,
    "memory_measured_context_bytes": 500 * 1024**2,
    "memory_estimate_bytes": 6 * 1024**3,
    "weight_bytes": 4 * 1024**3,
    "measured_load_s": 12.5,
    "measured_wake_s": 0.75,
    "load_failures": 2,
    "failed_reason": "SafetensorError: incomplete metadata",
    "retry_at": datetime(2026, 11, 28, 12, 0, tzinfo=UTC),
}
BEFORE = [("scheduling", "0030_hearing")]
AFTER = [("scheduling", "0031_deployment_observed")]


@pytest.mark.django_db(transaction=True)
def test_each_deployments_measured_and_decided_values_move_to_its_observed_record_and_back():
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(BEFORE)
        old = MigrationExecutor(connection).loader.project_state(BEFORE).apps.get_model("scheduling", "Deployment")
        old.objects.create(name="measured", model_source="/srv/models/measured", **MOVED)
        old.objects.create(name="fresh", model_source="/srv/models/fresh")

        executor = MigrationExecutor(connection)
        executor.migrate(AFTER)
        moved = executor.loader.project_state(AFTER).apps.get_model("scheduling", "DeploymentObserved")
        records = {o.deployment.name: o for o in moved.objects.select_related("deployment")}
        assert set(records) == {"measured", "fresh"}, "one record for every deployment"
        assert {key: getattr(records["measured"], key) for key in MOVED} == MOVED
        assert (records["fresh"].memory_measured_bytes, records["fresh"].load_failures) == (None, 0)

        executor = MigrationExecutor(connection)
        executor.migrate(BEFORE)
        back = executor.loader.project_state(BEFORE).apps.get_model("scheduling", "Deployment")
        assert {key: getattr(back.objects.get(name="measured"), key) for key in MOVED} == MOVED
    finally:
        MigrationExecutor(connection).migrate(latest)
