import io
import traceback
from pathlib import Path

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from gpuportal.wire import node_auth


class Command(BaseCommand):
    help = (
        "Migrate, make sure the admin user exists (ensure_admin) and issue a node's credential into "
        "a token file (node_credential issue --keep): what `up` does to its database before it starts "
        "the portal's processes, in one process rather than three, each of which would pay Django's start."
    )

    def add_arguments(self, parser):
        parser.add_argument("--node", required=True, help="The node whose credential to issue (up's agent's).")
        parser.add_argument("--token-file", type=Path, required=True, help="Where its agent reads the token.")
        parser.add_argument("--by", default="manage.py up", help="Who issues it, for the Event.")

    def handle(self, *args, node: str, token_file: Path, by: str, **options):
        # What migrate and node_credential say is for their own command lines; up shows the admin's line.
        self.step("migrate failed", "migrate", interactive=False, stdout=io.StringIO())
        self.step("could not create the admin user", "ensure_admin", stdout=self.stdout)
        # A name that is no node's is left for the agent to refuse, in its own words.
        if node_auth.NODE_NAME.fullmatch(node):
            self.step(
                f"could not issue node {node}'s credential",
                "node_credential", "issue", node, "--token-file", str(token_file), "--keep", "--by", by,
                stdout=io.StringIO(),
            )  # fmt: skip

    def step(self, failure: str, *command: str, **options) -> None:
        """One command, whose error is `failure` and the last line it would have printed as a
        command of its own: its CommandError, or the last line of its traceback."""
        try:
            call_command(*command, **options)
        except CommandError as err:
            raise CommandError(f"{failure}: CommandError: {_last_line(str(err))}") from None
        except Exception as err:
            last = _last_line("".join(traceback.format_exception_only(err)))
            raise CommandError(f"{failure}: {last}") from None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
