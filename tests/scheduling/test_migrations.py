"""The models and their migrations agree, so a clean checkout migrates to the state the code expects."""

import pytest
from django.core.management import call_command
from django.db import connection

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
