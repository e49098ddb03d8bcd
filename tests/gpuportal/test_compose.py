"""docker/compose.yaml and docker/Dockerfile, checked without a Docker engine.

CI has no engine, so these tests read the files and check that every command in them names
something that exists in this project: a management command, the Celery app and its queues and
scheduler, a WSGI callable. A renamed command or module then fails here, not on a GPU host.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
from pathlib import Path

import click
import pytest
import yaml
from celery.app.utils import find_app
from celery.beat import Scheduler
from celery.bin.celery import celery as celery_cli
from celery.utils.imports import symbol_by_name
from django.conf import settings
from django.core.management import CommandError, get_commands, load_command_class
from granian.cli import cli as granian_cli

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"

SERVICES = {"postgres", "redis", "migrate", "node-credential", "web", "control", "agents", "beat", "agent"}
APP_IMAGE = "gpuportal:latest"


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def as_argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def compose_commands() -> list[tuple[str, list[str]]]:
    """(service, argv) for every `command` and `entrypoint` in the compose file."""
    found = []
    for name, service in load_compose()["services"].items():
        for key in ("entrypoint", "command"):
            if service.get(key):
                found.append((f"{name}.{key}", as_argv(service[key])))
    return found


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def dockerfile_cmd() -> list[str]:
    cmds = [args for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()) if keyword == "CMD"]
    assert cmds, "docker/Dockerfile has no CMD"
    argv = json.loads(cmds[-1])  # exec form: a JSON array, so signals reach the process
    assert isinstance(argv, list) and all(isinstance(part, str) for part in argv)
    return argv


# --- what a command names, and whether it exists -------------------------------------------------


def check_manage_py(args: list[str]) -> None:
    assert args, "`python manage.py` without a command"
    name, rest = args[0], args[1:]
    commands = get_commands()
    assert name in commands, f"no management command {name!r} (is {name}.py written yet?)"
    command = load_command_class(commands[name], name)
    # Parse the arguments with the command's own parser: an unknown option raises CommandError.
    command.create_parser("manage.py", name).parse_args(rest)


def known_queues(app) -> set[str]:
    queues = {app.conf.task_default_queue}
    for queue in app.conf.task_queues or ():
        queues.add(getattr(queue, "name", queue))
    routes = app.conf.task_routes
    if isinstance(routes, dict):
        for route in routes.values():
            queue = route.get("queue") if isinstance(route, dict) else None
            queues.add(getattr(queue, "name", queue))
    queues.discard(None)
    return queues


def option_names(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def first_positional(command: click.Command, args: list[str]) -> int:
    """Index of the first argument that is neither one of `command`'s options nor an option's value."""
    takes_value = {
        opt
        for param in command.params
        if isinstance(param, click.Option) and not param.is_flag and not param.count
        for opt in param.opts
    }
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in takes_value
        else:
            return index
    raise AssertionError(f"no subcommand in celery {args}")


def check_celery(args: list[str]) -> None:
    # Group options first (-A gpuportal ...), up to the subcommand.
    group_ctx = celery_cli.make_context("celery", list(args), resilient_parsing=True)
    app_name = group_ctx.params["app"]
    assert app_name == "gpuportal", f"celery -A {app_name!r}: the app is gpuportal"
    package = importlib.import_module(app_name)
    assert hasattr(package, "celery_app"), "gpuportal.celery_app is missing (gpuportal/__init__.py)"
    app = find_app(app_name)  # the same lookup `celery -A` does
    assert app is package.celery_app

    subcommand_at = first_positional(celery_cli, args)
    subcommand, rest = args[subcommand_at], args[subcommand_at + 1 :]
    assert subcommand in ("worker", "beat"), f"celery {subcommand}: not a long-running role"
    command = celery_cli.commands[subcommand]
    # Celery's commands accept unknown options (as config overrides), so check names by hand.
    known = option_names(command)
    for arg in rest:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in known, f"celery {subcommand}: unknown option {arg}"
    params = command.make_context(subcommand, list(rest), parent=group_ctx, resilient_parsing=True).params

    if subcommand == "worker":
        queues = params["queues"] or []
        assert queues, "a worker without -Q consumes only the default queue; name it"
        missing = set(queues) - known_queues(app)
        assert not missing, f"worker queues {missing} are neither the default queue nor routed to"
    else:
        scheduler_path = params["scheduler"] or settings.CELERY_BEAT_SCHEDULER
        scheduler = symbol_by_name(scheduler_path)
        assert issubclass(scheduler, Scheduler), f"{scheduler_path} is not a celery beat scheduler"


def check_granian(args: list[str]) -> None:
    context = granian_cli.make_context("granian", list(args))  # an unknown option raises here
    assert context.params["interface"] == "wsgi", "gpuportal.wsgi:application is a WSGI app: --interface wsgi"
    target = context.params["app"]
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attribute or "application", None)), f"{target} is not callable"


def check_command(argv: list[str]) -> None:
    """Fail on a command whose target does not exist, and on a command form this test cannot read."""
    try:
        match argv:
            case ["python" | "python3", "manage.py", *rest]:
                check_manage_py(rest)
            case ["celery", *rest]:
                check_celery(rest)
            case ["granian", *rest]:
                check_granian(rest)
            case _:
                raise AssertionError(f"unrecognised command {argv}: teach tests/gpuportal/test_compose.py to check it")
    except (ImportError, AttributeError, CommandError, click.ClickException, SystemExit) as exc:
        # A module, attribute or option that does not exist, or an argument parser that refused.
        raise AssertionError(f"{shlex.join(argv)}: {exc!r}") from exc


# --- compose.yaml ---------------------------------------------------------------------------------


def test_compose_file_has_every_role_and_no_version_key():
    compose = load_compose()
    assert "version" not in compose, "Compose spec files have no version key"
    missing = SERVICES - set(compose["services"])
    assert not missing, f"compose.yaml lacks services {sorted(missing)}"


def test_app_services_share_one_image_built_from_the_repository():
    services = load_compose()["services"]
    for name in SERVICES - {"postgres", "redis"}:
        service = services[name]
        assert service["image"] == APP_IMAGE, name
        build = service["build"]
        context = (DOCKER / build["context"]).resolve()
        assert context == ROOT, f"{name}: the build context is the repository root"
        assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} is missing"
        environment = service["environment"]
        for key in ("DATABASE_URL", "REDIS_URL", "GPUPORTAL_SECRET_KEY", "GPUPORTAL_ALLOWED_HOSTS"):
            assert key in environment, f"{name} lacks {key}"
        assert environment["DATABASE_URL"].startswith("postgres://") and "@postgres:" in environment["DATABASE_URL"]
        assert environment["REDIS_URL"].startswith("redis://redis:")
        assert environment["GPUPORTAL_SECRET_KEY"].startswith("${GPUPORTAL_SECRET_KEY:?"), "no default key"


def test_agent_reserves_nvidia_gpus():
    agent = load_compose()["services"]["agent"]
    devices = agent["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_postgres_and_redis_have_healthchecks_the_app_waits_for():
    services = load_compose()["services"]
    assert "pg_isready" in as_argv(services["postgres"]["healthcheck"]["test"])
    assert as_argv(services["redis"]["healthcheck"]["test"])[-2:] == ["redis-cli", "ping"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_web_and_workers_start_after_migrations_complete():
    services = load_compose()["services"]
    assert as_argv(services["migrate"]["command"])[:3] == ["python", "manage.py", "migrate"]
    assert services["migrate"]["restart"] == "no"
    for name in ("web", "control", "agents", "beat", "agent"):
        condition = services[name]["depends_on"]["migrate"]["condition"]
        assert condition == "service_completed_successfully", name


def test_every_command_form_in_this_test_is_checked_against_real_and_missing_targets():
    """The checker itself: it accepts what exists and rejects what does not."""
    check_command(["python", "manage.py", "migrate", "--noinput"])
    check_command(["granian", "--interface", "wsgi", "--workers", "2", "gpuportal.wsgi:application"])
    check_command(["celery", "-A", "gpuportal", "worker", "-Q", "control"])
    check_command(["celery", "-A", "gpuportal", "beat", "-S", "django_celery_beat.schedulers:DatabaseScheduler"])
    rejected = [
        ["python", "manage.py", "no_such_command"],
        ["python", "manage.py", "migrate", "--no-such-option"],
        ["granian", "--interface", "wsgi", "gpuportal.wsgi:no_such_app"],
        ["granian", "--interface", "wsgi", "gpuportal.no_such_module:application"],
        ["granian", "--interface", "wsgi", "--no-such-option", "gpuportal.wsgi:application"],
        ["granian", "gpuportal.wsgi:application"],
        ["celery", "-A", "gpuportal", "worker", "-Q", "no_such_queue"],
        ["celery", "-A", "gpuportal", "worker", "--no-such-option", "-Q", "control"],
        ["celery", "-A", "gpuportal", "beat", "--scheduler", "django_celery_beat.schedulers:Nope"],
        ["uvicorn", "gpuportal.asgi:application"],
    ]
    for argv in rejected:
        with pytest.raises(AssertionError):
            check_command(argv)


@pytest.mark.parametrize(("where", "argv"), compose_commands(), ids=[w for w, _ in compose_commands()])
def test_every_compose_command_names_something_that_exists(where, argv):
    check_command(argv)


def test_compose_covers_every_app_role_with_a_command():
    checked = {where.split(".")[0] for where, _ in compose_commands()}
    assert {"migrate", "web", "control", "agents", "beat", "agent"} <= checked


# --- Dockerfile -----------------------------------------------------------------------------------


def test_dockerfile_default_command_names_something_that_exists():
    argv = dockerfile_cmd()
    assert argv[0] == "granian"
    check_command(argv)


def test_dockerfile_management_commands_exist():
    """`RUN python manage.py X` at build time (collectstatic) names a real command."""
    runs = [args for keyword, args in dockerfile_instructions(DOCKERFILE.read_text()) if keyword == "RUN"]
    names = [m.group(1) for run in runs for m in re.finditer(r"manage\.py\s+(\w+)", run)]
    assert "collectstatic" in names
    commands = get_commands()
    for name in names:
        assert name in commands, f"Dockerfile runs manage.py {name}, which does not exist"


def test_dockerfile_builds_one_non_root_image_for_every_role():
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    keywords = [keyword for keyword, _ in instructions]
    assert instructions[0] == ("FROM", "python:3.11-slim")
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image runs as a non-root user"
    assert ("EXPOSE", "8000") in instructions
    env = " ".join(args for keyword, args in instructions if keyword == "ENV")
    assert "PYTHONUNBUFFERED=1" in env and "DJANGO_SETTINGS_MODULE=gpuportal.settings" in env
    runs = [args for keyword, args in instructions if keyword == "RUN"]
    torch_at = next(i for i, run in enumerate(runs) if "torch==" in run)
    project_at = next(i for i, run in enumerate(runs) if re.search(r"pip install (\S+ )*\.(\s|$)", run))
    assert torch_at < project_at, "torch is installed (pinned) before the project"
    pinned = re.search(r"torch==([\w.+]+)", runs[torch_at]).group(1)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch=={pinned}"' in pyproject, "the Dockerfile's torch pin matches pyproject.toml"
    assert keywords.index("USER") < max(i for i, (k, a) in enumerate(instructions) if "collectstatic" in a)
