import secrets
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from gpuportal.stackenv import write_private
from gpuportal.wire import node_acl, node_auth
from scheduling.services import node_credentials
from scheduling.services.errors import ServiceError


class Command(BaseCommand):
    help = (
        "Issue or revoke a node's credential, the token its agent sends with every call "
        "(`gpuportal node add/revoke` does the same through the API). `up` issues its own node's."
    )

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        issue = sub.add_parser("issue", help="A new token for the node (its previous one is refused from now on).")
        issue.add_argument("node")
        issue.add_argument(
            "--token-file",
            type=Path,
            help=f"Write the token to this file (mode 0600) for the agent's {node_auth.TOKEN_FILE_ENV}, "
            "rather than print it.",
        )
        issue.add_argument(
            "--keep",
            action="store_true",
            help="With --token-file: keep the token the file holds while it is still the node's valid credential.",
        )
        issue.add_argument("--by", default="manage.py node_credential", help="Who issues it, for the Event.")
        revoke = sub.add_parser("revoke", help="Refuse the node's calls from now on and write it off.")
        revoke.add_argument("node")
        revoke.add_argument("--reason", default="")
        revoke.add_argument("--by", default="manage.py node_credential")
        acl = sub.add_parser(
            "acl",
            help="Print the ACL SETUSER line of the node's own Redis user, to run in redis-cli; "
            "or, with --apply, make the user and print its agent's REDIS_URL.",
        )
        acl.add_argument("node")
        acl.add_argument("--password", help="The user's password (default: one made now, printed with the line).")
        acl.add_argument(
            "--apply",
            action="store_true",
            help="Make (or remake) the user through the control plane's REDIS_URL, whose user needs @admin, "
            "and print only the node's REDIS_URL. The control plane keeps such a user: it reaches the queues "
            "of the deployments placed on the node alone (the printed line reaches every deployment's).",
        )
        acl.add_argument("--by", default="manage.py node_credential", help="Who makes it, for the Event (--apply).")

    def handle(self, *args, action: str, node: str, **options):
        by = options["by"]
        try:
            if action == "acl" and options["apply"]:
                url = node_credentials.make_redis_user(node, options["password"] or secrets.token_urlsafe(24), by)
                self.stdout.write(url)
                self.stderr.write(
                    f"node {node}'s Redis user {node_acl.user_name(node)} made: give its agent this REDIS_URL "
                    "(from another host, with the address by which that host reaches this Redis)."
                )
                return
            if action == "acl":
                self.acl(node, options["password"] or secrets.token_urlsafe(24))
                return
            if action == "revoke":
                node_credentials.revoke(node, by, options["reason"])
                self.stdout.write(f"node {node}'s credential revoked: its calls are refused and it is written off")
                return
            path: Path | None = options["token_file"]
            if options["keep"] and path is None:
                raise CommandError("--keep needs --token-file")
            if options["keep"] and path.exists():
                kept = path.read_text().strip()
                if kept and node_credentials.holds(node_credentials.check_name(node), kept):
                    self.stdout.write(f"node {node}'s credential in {path} is still valid: kept")
                    return
            token = node_credentials.issue(node, by)
        except ServiceError as err:
            raise CommandError(str(err)) from None
        if path is None:
            self.stdout.write(token)
            return
        write_private(path, token + "\n")
        self.stdout.write(f"node {node}'s credential issued; its token is in {path} ({node_auth.TOKEN_FILE_ENV})")

    def acl(self, node: str, password: str) -> None:
        try:
            line = node_acl.setuser_line(node, password)
        except ValueError as err:
            raise CommandError(str(err)) from None
        self.stdout.write(line)
        self.stderr.write(
            f"Then give node {node}'s agent REDIS_URL=redis://{node_acl.user_name(node)}:PASSWORD@HOST:PORT/DB "
            "(what the rules cannot keep apart is in gpuportal/wire/node_acl.py)."
        )
