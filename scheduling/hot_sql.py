"""The statements a scale call runs every time, sent without Django compiling them anew, to
spare the client CPU. On a call of about ten statements, Django building each one's SQL cost the client about
as much CPU as PostgreSQL spent running them; here each statement's text is built once per shape
from the model's own fields, values are prepared by those fields (`get_db_prep_save`, the
conversion Django applies), and psycopg prepares the statement on the server after a few runs.

Everything goes through the connection Django manages, inside the caller's transaction, with
database errors turned into Django's (so `locks.retry_deadlocks` and `transaction.atomic` see
them as they see the ORM's)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from django.db import connection, models


class _Cursor(psycopg.Cursor):
    """A server-binding cursor (psycopg prepares what it runs often) whose statements show in
    Django's query log when it is kept (tests' CaptureQueriesContext, DEBUG), as the ORM's do."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> _Cursor:  # type: ignore[override]
        if connection.queries_logged:
            connection.queries_log.append({"sql": query, "params": params, "time": "0.000"})
        super().execute(query, params, **kwargs)
        return self

    def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:  # type: ignore[override]
        params_seq = list(params_seq)
        if connection.queries_logged:
            connection.queries_log.append({"sql": f"{query} -- × {len(params_seq)}", "params": None, "time": "0.000"})
        super().executemany(query, params_seq, **kwargs)


STATEMENTS = Path(__file__).resolve().parent / "sql" / "statements"


@functools.cache
def statement(name: str, **fill: str) -> str:
    """The text of `sql/statements/<name>.sql` with its placeholders (such as `{gone}`) filled by
    `fill`: names the code owns, never values, which go as parameters. Read once per process."""
    text = (STATEMENTS / f"{name}.sql").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
    return body.format(**fill).strip() if fill else body.strip()


@contextmanager
def cursor() -> Iterator[psycopg.Cursor]:
    """A cursor on Django's connection, in the caller's transaction."""
    connection.ensure_connection()
    with connection.wrap_database_errors, _Cursor(connection.connection) as cur:
        yield cur


def columns(model: type[models.Model], table: str = "") -> str:
    """The model's columns in `instance`'s order, each qualified by `table` (an alias) if given."""
    prefix = f"{table}." if table else ""
    return ", ".join(prefix + connection.ops.quote_name(f.column) for f in model._meta.concrete_fields)


def instance(model: type[models.Model], row: Sequence[Any]) -> models.Model:
    """A model instance from a row of `columns(model)` (fields without database converters only,
    which `test_hot_sql` checks for the models read this way)."""
    return model.from_db(connection.alias, [f.attname for f in model._meta.concrete_fields], row)


@functools.cache
def _insert_sql(model: type[models.Model], rows: int) -> str:
    fields = _insert_fields(model)
    values = "(" + ", ".join(["%s"] * len(fields)) + ")"
    return f"INSERT INTO {connection.ops.quote_name(model._meta.db_table)} ({_insert_columns(model)}) VALUES " + (
        ", ".join([values] * rows)
    )


@functools.cache
def _insert_fields(model: type[models.Model]) -> tuple[models.Field, ...]:
    # An automatic primary key is the database's to choose, as in Django's own INSERT.
    return tuple(f for f in model._meta.concrete_fields if not (f.primary_key and f.db_returning))


@functools.cache
def _insert_columns(model: type[models.Model]) -> str:
    return ", ".join(connection.ops.quote_name(f.column) for f in _insert_fields(model))


def insert(objs: Sequence[models.Model]) -> None:
    """Rows for these unsaved instances of one model, in one statement: what `bulk_create` writes
    (fields' `pre_save` fills auto_now dates as it does), without the ids of automatic keys read
    back, so only for callers that do not need them. The instances count as saved from now."""
    if not objs:
        return
    model = type(objs[0])
    fields = _insert_fields(model)
    rows: list[list[Any]] = []
    for obj in objs:
        obj._state.adding = False
        obj._state.db = connection.alias
        rows.append([f.get_db_prep_save(f.pre_save(obj, True), connection) for f in fields])
    # One statement of one row's text, sent once per row in a pipeline (one round trip): psycopg
    # keeps the parsed text and the server the plan of a short statement, while a statement of many
    # rows' values (over 50 parameters) was parsed again on every call, its costliest part.
    with cursor() as cur:
        if len(rows) == 1:
            cur.execute(_insert_sql(model, 1), rows[0])
        else:
            cur.executemany(_insert_sql(model, 1), rows)


def update(obj: models.Model, fields: Sequence[str]) -> None:
    """`obj.save(update_fields=fields)` for a row known to be there, its auto_now dates with it."""
    meta = type(obj)._meta
    chosen = [meta.get_field(name) for name in fields]
    chosen += [f for f in meta.concrete_fields if getattr(f, "auto_now", False) and f not in chosen]
    _update(type(obj), obj.pk, {f: f.pre_save(obj, False) for f in chosen})


def _update(model: type[models.Model], pk: Any, values: dict[models.Field, Any]) -> None:
    prepared = [f.get_db_prep_save(value, connection) for f, value in values.items()]
    with cursor() as cur:
        cur.execute(_update_sql(model, tuple(f.column for f in values)), [*prepared, pk])


@functools.cache
def _update_sql(model: type[models.Model], cols: tuple[str, ...]) -> str:
    quote = connection.ops.quote_name
    assignments = ", ".join(f"{quote(c)} = %s" for c in cols)
    return f"UPDATE {quote(model._meta.db_table)} SET {assignments} WHERE {quote(model._meta.pk.column)} = %s"
