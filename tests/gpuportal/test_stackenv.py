"""How a process finds the stack: environment first, then the stack.env a running `up` wrote."""

from gpuportal.settings import database_from_url
from gpuportal.stackenv import read_stack_env, resolve_stack_urls, write_stack_env


def test_urls_in_the_environment_win_over_stack_env(tmp_path):
    write_stack_env(tmp_path / "stack.env", {"DATABASE_URL": "postgres://file/db", "REDIS_URL": "redis://file"})
    env = {"GPUPORTAL_DATA_DIR": str(tmp_path), "DATABASE_URL": "postgres://env/db"}

    assert resolve_stack_urls(env) == {"DATABASE_URL": "postgres://env/db", "REDIS_URL": "redis://file"}


def test_without_a_running_stack_nothing_is_resolved(tmp_path):
    assert resolve_stack_urls({"GPUPORTAL_DATA_DIR": str(tmp_path)}) == {}


def test_stack_env_can_be_sourced_by_a_shell_and_read_back(tmp_path):
    path = tmp_path / "stack.env"
    write_stack_env(path, {"DATABASE_URL": "postgres://postgres@127.0.0.1:5999/gpuportal"})

    assert "export DATABASE_URL=postgres://postgres@127.0.0.1:5999/gpuportal" in path.read_text()
    assert read_stack_env(path) == {"DATABASE_URL": "postgres://postgres@127.0.0.1:5999/gpuportal"}


def test_database_urls_become_django_settings():
    db = database_from_url("postgres://u:p%40ss@db.example:6543/portal?sslmode=require")
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"], db["NAME"]) == (
        "u",
        "p@ss",
        "db.example",
        "6543",
        "portal",
    )
    assert db["OPTIONS"] == {"sslmode": "require", "prepare_threshold": 5}
