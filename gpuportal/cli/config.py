"""Where the portal is and the token to show it: stored by `gpuportal login` in a file only its
owner reads, overridden by the environment (a CI job or a second portal needs no file)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuportal.cli.client import CliError
from gpuportal.stackenv import CLI_URL_KEY, read_stack_env
from gpuportal.wire import adapters

DEFAULT_URL = "http://127.0.0.1:8000"


class ConfigError(Exception):
    """The stored settings cannot be read, or say nothing usable."""


@dataclass(frozen=True)
class Settings:
    url: str
    token: str | None


def config_path(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("GPUPORTAL_CONFIG"):
        return Path(env["GPUPORTAL_CONFIG"]).expanduser()
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "gpuportal" / "cli.json"


def normal_url(url: str) -> str:
    """The base URL as the client joins paths to it: with a scheme, without a trailing slash."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url


def read_stored(path: Path) -> dict[str, str]:
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    if not isinstance(stored, dict):
        raise ConfigError(f"{path} is not a JSON object; run `gpuportal login` again")
    return {k: v for k, v in stored.items() if isinstance(v, str)}


def load(env: Mapping[str, str] = os.environ) -> Settings:
    """The environment's GPUPORTAL_URL / GPUPORTAL_TOKEN, else what login stored, else the address
    of the `up` running beside this shell (its data directory's stack.env), else the default URL."""
    stored = read_stored(config_path(env))
    url = env.get("GPUPORTAL_URL") or stored.get("url") or up_url(env) or DEFAULT_URL
    token = env.get("GPUPORTAL_TOKEN") or stored.get("token") or None
    return Settings(url=normal_url(url), token=token)


def store(settings: Settings, env: Mapping[str, str] = os.environ) -> Path:
    """Write {url, token} readable by its owner only; created 0600 from the start, so the token
    is never readable by others, not even between the write and a chmod."""
    path = config_path(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"url": settings.url, "token": settings.token}, out)
        out.write("\n")
    # A file kept from an older write keeps its mode through os.open: say 0600 again.
    os.chmod(partial, 0o600)
    os.replace(partial, path)
    return path


def model_source(source: str) -> str:
    """A model directory that exists here is sent as an absolute path: the portal resolves paths
    on its nodes, not in this shell's directory. Anything else (a `package.module:factory`, a
    path only the nodes have) is sent as written."""
    path = Path(source).expanduser()
    if ("/" in source or source.startswith((".", "~"))) and path.exists():
        return str(path.resolve())
    return source


def adapter_sources(text: str) -> str:
    """`name=source,...` with each source as `model_source` sends a model's; CliError naming what
    is wrong with the text."""
    try:
        named = adapters.parse(text)
    except ValueError as err:
        raise CliError(f"--adapters: {err}") from None
    return ",".join(f"{name}={model_source(source)}" for name, source in named.items())


def up_url(env: Mapping[str, str]) -> str | None:
    """The web address a running `up` wrote in its data directory (GPUPORTAL_DATA_DIR, or ./var as
    up's own default), so that `gpuportal login` in the checkout finds the port up chose."""
    data_dir = Path(env.get("GPUPORTAL_DATA_DIR") or Path.cwd() / "var")
    return read_stack_env(data_dir / "stack.env").get(CLI_URL_KEY) or None
