"""How a process finds the stack: environment first, then the stack.env a running `up` wrote."""

import shlex

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


def test_a_shell_that_sources_stack_env_gets_tls_urls_whole(tmp_path):
    urls = {
        "DATABASE_URL": "postgres://u:p%40ss@db.example:5432/portal?sslmode=verify-full&sslrootcert=/etc/ca/ca.crt",
        "REDIS_URL": "rediss://:pw@redis.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca/ca.crt",
    }
    path = tmp_path / "stack.env"
    write_stack_env(path, urls)

    lines = path.read_text().splitlines()
    for key, url in urls.items():
        line = next(line for line in lines if line.startswith(f"export {key}="))
        # The words and control operators (`&`, `;`, ...) a POSIX shell reads in the line: an
        # unquoted `&` would end the export there and run it in the background, setting nothing.
        shell = shlex.shlex(line, posix=True, punctuation_chars=True)
        shell.whitespace_split = True
        assert list(shell) == ["export", f"{key}={url}"]
    assert read_stack_env(path) == urls


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
