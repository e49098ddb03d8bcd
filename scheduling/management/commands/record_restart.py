from django.core.management.base import BaseCommand

from scheduling.services.supervision import record_restart


class Command(BaseCommand):
    help = "Record that a process of the stack died and was started again (`up` runs this)."
    # Run once for each restart, perhaps many in a crash loop: the checks (the URLconf, the
    # templates, a third of this command's CPU) ran when `up` prepared the database.
    requires_system_checks: list = []

    def add_arguments(self, parser):
        parser.add_argument("process", help="The process: web, control, beat, agents, agent, postgresql, redis.")
        parser.add_argument("--reason", required=True, help="Why it was started again: how it ended.")
        parser.add_argument("--node", default="", help="The node whose stack it belongs to.")

    def handle(self, *args, process: str, reason: str, node: str, **options):
        event = record_restart(process, reason, node=node)
        self.stdout.write(f"recorded {event.kind} for {event.subject}")
