from django.core.management.base import BaseCommand

from scheduling.services.supervision import record_restart


class Command(BaseCommand):
    help = "Record that a process of the stack died and was started again (`up` runs this)."

    def add_arguments(self, parser):
        parser.add_argument("process", help="The process: web, control, beat, agents, agent, postgresql, redis.")
        parser.add_argument("--reason", required=True, help="Why it was started again: how it ended.")
        parser.add_argument("--node", default="", help="The node whose stack it belongs to.")

    def handle(self, *args, process: str, reason: str, node: str, **options):
        event = record_restart(process, reason, node=node)
        self.stdout.write(f"recorded {event.kind} for {event.subject}")
