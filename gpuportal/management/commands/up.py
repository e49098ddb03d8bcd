import os
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from gpuportal.stack import StackError
from gpuportal.stackenv import default_data_dir
from gpuportal.up import Options, Portal

# More would only contend for the database's connections (each process holds its own) and memory.
MAX_WEB_WORKERS = 32


def _web_workers(given: int | None) -> int:
    if given is None:
        raw = os.environ.get("GPUPORTAL_WEB_WORKERS", "").strip() or "1"
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_WEB_WORKERS:
            raise CommandError(f"GPUPORTAL_WEB_WORKERS={raw!r} is not a whole number between 1 and {MAX_WEB_WORKERS}")
        return int(raw)
    if not 1 <= given <= MAX_WEB_WORKERS:
        raise CommandError(f"--web-workers {given} is not between 1 and {MAX_WEB_WORKERS}")
    return given


class Command(BaseCommand):
    help = (
        "Start the whole portal: PostgreSQL and Redis (embedded unless DATABASE_URL / REDIS_URL are set), "
        "migrations, an admin user, the web server, a control worker, beat and one node agent. "
        "Ctrl-C stops everything."
    )
    # The servers may not exist yet: the checks would try to reach them.
    requires_system_checks: list = []

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="Web server address (default 127.0.0.1).")
        parser.add_argument("--port", type=int, default=8000, help="Web server port (default 8000).")
        parser.add_argument("--node", default="local", help="Name of the node agent started here.")
        parser.add_argument(
            "--virtual-gpus",
            default=os.environ.get("GPUPORTAL_VIRTUAL_GPUS"),
            help="Virtual GPUs for the agent when no NVIDIA GPU is present (default 2x24GiB).",
        )
        parser.add_argument(
            "--web-workers",
            type=int,
            default=None,
            help="Web server processes (GPUPORTAL_WEB_WORKERS, default 1): on a control host with cores to "
            "spare, API calls then run side by side rather than on one interpreter.",
        )
        parser.add_argument("--data-dir", default=None, help="Where state lives (GPUPORTAL_DATA_DIR, default ./var).")
        parser.add_argument("--quiet", action="store_true", help="Only write the children's output to log files.")
        parser.add_argument(
            "--verbose", action="store_true", help="Show all of the children's output, not only warnings and errors."
        )

    def handle(self, *args, host, port, node, virtual_gpus, web_workers, data_dir, quiet, verbose, **options):
        if not 1 <= port <= 65535:
            raise CommandError(f"--port {port} is not a TCP port")
        web_workers = _web_workers(web_workers)
        options = Options(
            data_dir=Path(data_dir).resolve() if data_dir else default_data_dir(),
            host=host,
            port=port,
            node=node,
            virtual_gpus=virtual_gpus,
            web_workers=web_workers,
            quiet=quiet,
            verbose=verbose,
            # Only the environment counts here: a stack.env left by another `up` names servers
            # that this one is about to start itself.
            database_url=os.environ.get("DATABASE_URL") or None,
            redis_url=os.environ.get("REDIS_URL") or None,
        )
        try:
            code = Portal(options, out=sys.stdout).run()
        except StackError as err:
            raise CommandError(str(err)) from None
        if code:
            raise CommandError("stopped with errors")
