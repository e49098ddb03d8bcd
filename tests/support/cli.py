"""The `gpuportal` command line as a staff user runs it against a test's live server."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def staff_cli(live_server, capsys: pytest.CaptureFixture[str], *command: str) -> Callable[..., tuple[int, str, str]]:
    """A runner of `gpuportal COMMAND... ARGV...` as a new staff user: (exit code, stdout, stderr),
    each stripped."""
    from django.contrib.auth.models import User
    from rest_framework.authtoken.models import Token

    from gpuportal.cli import app

    staff = User.objects.create_user("ops", is_staff=True)
    env = {"GPUPORTAL_URL": live_server.url, "GPUPORTAL_TOKEN": Token.objects.create(user=staff).key}

    def run(*argv: str) -> tuple[int, str, str]:
        code = app.main([*command, *argv], env=env)
        out, err = capsys.readouterr()
        return code, out.strip(), err.strip()

    return run
