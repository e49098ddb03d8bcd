"""The models and their migrations agree, so a clean checkout migrates to the state the code expects."""

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_model_change_is_missing_a_migration():
    # --check exits non-zero (SystemExit) when makemigrations would write a migration.
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)
