"""Django's dummy backend, whose every use says why this process has no database."""

from __future__ import annotations

from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.dummy import base as dummy

ENGINE = "gpuportal.no_database"
WHY = (
    "a node agent opens no database, whatever DATABASE_URL says: it reaches the control plane through "
    "Redis alone (gpuportal.wire.control), and the control plane alone writes the database"
)


def refuse(*args: Any, **kwargs: Any) -> NoReturn:
    raise ImproperlyConfigured(WHY)


class DatabaseOperations(dummy.DatabaseOperations):
    quote_name = refuse


class DatabaseIntrospection(dummy.DatabaseIntrospection):
    get_table_list = get_table_description = get_relations = get_indexes = refuse


class DatabaseWrapper(dummy.DatabaseWrapper):
    ops_class = DatabaseOperations
    introspection_class = DatabaseIntrospection
    _cursor = refuse
    ensure_connection = refuse
    _commit = refuse
    _savepoint_commit = refuse
    _set_autocommit = refuse
