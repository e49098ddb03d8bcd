"""The `<data dir>/stack.env` file through which `up` tells processes started beside it
which PostgreSQL and Redis to use (plain KEY=VALUE lines, so a shell can `source` it); and
`<data dir>/stack-status.json`, which of its processes are down now, for /readyz to name."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

STACK_KEYS = ("DATABASE_URL", "REDIS_URL")
# The web's address, for the command line run beside `up` (gpuportal.cli.config): the port up
# chose is found without typing it.
CLI_URL_KEY = "GPUPORTAL_URL"


def default_data_dir() -> Path:
    return Path(os.environ.get("GPUPORTAL_DATA_DIR") or Path.cwd() / "var").resolve()


def read_stack_env(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except (FileNotFoundError, PermissionError):
        return {}
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.removeprefix("export ").partition("=")
        try:
            words = shlex.split(value)  # as the shell that sources the file reads it
        except ValueError:  # unbalanced quotes: not written by write_stack_env
            words = [value.strip().strip("'\"")]
        values[key.strip()] = " ".join(words)
    return values


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, which only its owner may read (it holds a password), replaced whole:
    made anew with mode 0600 beside it (a file kept from before would keep its own mode), then
    renamed over it, so no reader sees it half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    tmp.replace(path)


def write_stack_env(path: Path, values: dict[str, str]) -> None:
    """Only its owner may read it: the URLs carry the servers' passwords. Each value is quoted for
    the shell where it needs it: a URL with TLS parameters (`?sslmode=...&sslrootcert=...`) holds
    `&`, which a shell that sources the file would take for the end of a command, run in the
    background, and the variable would never be set."""
    lines = ["# Written by `manage.py up`: the servers of the running stack."]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in values.items()]
    write_private(path, "\n".join(lines) + "\n")


STATUS_FILE = "stack-status.json"


def write_status(data_dir: Path, down: dict[str, str]) -> None:
    """The processes of `up` that are down now ({name: why}), replaced whole."""
    write_private(data_dir / STATUS_FILE, json.dumps({"down": down}))


def read_status(data_dir: Path) -> dict[str, str]:
    """The processes `up` says are down ({} with no `up` beside: nothing to say)."""
    try:
        return dict(json.loads((data_dir / STATUS_FILE).read_text()).get("down", {}))
    except (FileNotFoundError, PermissionError, ValueError):
        return {}


def redact(url: str) -> str:
    """`url` with its password, if any, shown as ***: for banners and logs."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def resolve_stack_urls(environ: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    """URLs from the environment first, then from a running `up`'s stack.env."""
    urls = {key: environ[key] for key in STACK_KEYS if environ.get(key)}
    if len(urls) < len(STACK_KEYS):
        data_dir = Path(environ.get("GPUPORTAL_DATA_DIR") or Path.cwd() / "var")
        from_file = read_stack_env(data_dir / "stack.env")
        for key in STACK_KEYS:
            if key not in urls and from_file.get(key):
                urls[key] = from_file[key]
    return urls
