import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from gpuportal.celery import app
from gpuportal.no_database.base import ENGINE as NO_DATABASE
from gpuportal.wire import node_auth, node_labels
from inference import load_slots
from inference.agent import LABELS_ENV, TAINTS_ENV, NodeAgent
from inference.devices import FOREIGN_ENV, VirtualProfile, parse_size, parse_virtual_foreign, parse_virtual_spec
from inference.devices import virtual_gpus as declared_virtual_gpus
from inference.gateway import RemoteControl


class Command(BaseCommand):
    help = (
        "Run this host's node agent: register the node and its GPUs (NVML, or virtual GPUs where "
        "there is no NVIDIA GPU), heartbeat, and run a Celery worker on the node's queue."
    )
    # A node serves no URL and may hold no database credential: the checks (the whole URLconf read,
    # about a second of CPU) belong to the control plane's `migrate` and `up`, not to each agent.
    requires_system_checks: list = []

    def add_arguments(self, parser):
        parser.add_argument(
            "--node",
            required=True,
            help="Node name: letters, digits, '.', '-' and '_' (a host's name, such as ip-10-0-1-2.ec2.internal).",
        )
        parser.add_argument(
            "--virtual-gpus",
            default=None,
            help="Virtual GPUs when no NVIDIA GPU is present, e.g. 2x24GiB or 1x80GiB,2x24GiB "
            "(default: GPUPORTAL_VIRTUAL_GPUS or 2x24GiB).",
        )
        parser.add_argument(
            "--backend",
            choices=["auto", "nvml", "virtual"],
            default="auto",
            help="auto: NVML when it finds a GPU, else virtual.",
        )
        parser.add_argument(
            "--virtual-context",
            default=None,
            help="A virtual GPU's CUDA context per serving replica process, e.g. 722MiB (default: the H100's, "
            "or GPUPORTAL_VIRTUAL_CONTEXT_BYTES).",
        )
        parser.add_argument(
            "--virtual-standby-context",
            default=None,
            help="A virtual GPU's context per standby that never ran a forward pass (default: 518MiB).",
        )
        parser.add_argument(
            "--virtual-driver-reserve",
            default=None,
            help="What NVML counts but CUDA cannot allocate on a virtual GPU (default: 480MiB).",
        )
        parser.add_argument(
            "--virtual-foreign",
            default=None,
            help="Memory other tenants hold on virtual GPUs, INDEX:SIZE[,INDEX:SIZE], e.g. 0:1GiB "
            "(default: GPUPORTAL_VIRTUAL_FOREIGN, else none). Out of placement's reach, as on a real GPU.",
        )
        parser.add_argument(
            "--cpu-cache",
            default=None,
            help="Host RAM for sleeping weights (default: GPUPORTAL_HOST_CACHE_BYTES, else half of RAM).",
        )
        parser.add_argument(
            "--host-ram",
            default=None,
            help="Host RAM the node's host cache and replica processes may use together; no new replica "
            "starts past it (default: GPUPORTAL_HOST_RAM_BYTES, else all of RAM).",
        )
        parser.add_argument(
            "--labels",
            default=None,
            help="What this host is, key=value,... such as gpu=h100,zone=b: a deployment's "
            "placement.node_selector keeps its replicas on the nodes whose labels hold every pair it names "
            f"(default: {LABELS_ENV}, else none).",
        )
        parser.add_argument(
            "--taints",
            default=None,
            help="What this node keeps off, key=value,... such as team=research: only deployments whose "
            "placement.tolerations name each of them are placed here; what runs here already stays, but for "
            "a taint written key=value:NoExecute, which moves it off; key=value:PreferNoSchedule keeps nothing "
            f"off but makes this node placement's last choice (default: {TAINTS_ENV}, else none).",
        )
        parser.add_argument("--concurrency", type=int, default=4, help="Worker threads for node tasks.")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, node: str, virtual_gpus, backend, cpu_cache, concurrency, loglevel, **options):
        if (problem := node_auth.node_name_problem(node)) is not None:
            raise CommandError(f"--node {problem}")
        try:
            if virtual_gpus is not None:
                parse_virtual_spec(virtual_gpus)
            # The host cache's budget: the flag, else the operator's setting, else half of RAM.
            cpu_cache = cpu_cache or os.environ.get("GPUPORTAL_HOST_CACHE_BYTES") or None
            cache = parse_size(cpu_cache) if cpu_cache else None
            host_ram = options.get("host_ram") or os.environ.get("GPUPORTAL_HOST_RAM_BYTES") or None
            ram = parse_size(host_ram) if host_ram else None
        except ValueError as err:
            raise CommandError(f"invalid size: {err}") from None
        overrides = {
            "GPUPORTAL_VIRTUAL_CONTEXT_BYTES": ("--virtual-context", options.get("virtual_context")),
            "GPUPORTAL_VIRTUAL_STANDBY_CONTEXT_BYTES": (
                "--virtual-standby-context",
                options.get("virtual_standby_context"),
            ),
            "GPUPORTAL_VIRTUAL_DRIVER_RESERVE_BYTES": (
                "--virtual-driver-reserve",
                options.get("virtual_driver_reserve"),
            ),
        }
        env = dict(os.environ)
        for var, (flag, value) in overrides.items():
            if value is not None:
                try:
                    env[var] = str(parse_size(value)) if value.strip() != "0" else "0"
                except ValueError as err:
                    raise CommandError(f"{flag}: {err}") from None
        try:
            profile = VirtualProfile.from_env(env)
        except ValueError as err:
            raise CommandError(f"invalid virtual GPU profile: {err}") from None
        if virtual_gpus is not None:
            try:  # before anything starts: a GPU with no room for one replica is a typo, not a node
                declared_virtual_gpus(node, virtual_gpus, profile)
            except ValueError as err:
                raise CommandError(f"--virtual-gpus {virtual_gpus}: {err}") from None
        foreign = self._virtual_foreign(node, options.get("virtual_foreign"), virtual_gpus, profile)
        labels = self._pairs("--labels", options.get("labels"), LABELS_ENV)
        taints = self._pairs("--taints", options.get("taints"), TAINTS_ENV, taints=True)
        # The agent's replica processes inherit the environment: they model the same GPU, and
        # share the node's load slots.
        os.environ.update(profile.as_env())
        os.environ[load_slots.SLOTS_DIR_ENV] = str(Path(settings.GPUPORTAL_DATA_DIR) / "load-slots" / node)
        os.environ[load_slots.MAX_LOADS_ENV] = str(settings.GPUPORTAL_MAX_LOADS_PER_NODE)
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        try:
            token = node_auth.read_token()
        except node_auth.TokenError as err:
            raise CommandError(f"node {node}'s credential: {err}") from None
        # Given a DATABASE_URL or not (a shell that sourced stack.env), the agent opens no database,
        # and its replicas do not inherit the credentials.
        os.environ.pop("DATABASE_URL", None)
        without_database()
        agent = NodeAgent(
            node,
            # The data plane talks to the control plane only through this gateway
            # (gpuportal.wire.control): calls on the `agents` queue, answered by its worker, each
            # with the node's credential.
            control=RemoteControl(app, settings.REDIS_URL, token=token, node=node),
            backend=backend,
            virtual_spec=virtual_gpus,
            cpu_cache_bytes=cache,
            host_ram_bytes=ram,
            concurrency=concurrency,
            profile=profile,
            virtual_foreign=foreign,
            labels=labels,
            taints=taints,
        )
        try:
            agent.run(loglevel=loglevel)
        except ValueError as err:
            raise CommandError(str(err)) from None

    @staticmethod
    def _pairs(flag: str, value: str | None, env: str, *, taints: bool = False) -> dict[str, str]:
        """The host's labels or taints, checked before anything starts."""
        flag = flag if value is not None else env
        text = value if value is not None else os.environ.get(env, "")
        try:
            return node_labels.parse(text, taints=taints)
        except ValueError as err:
            raise CommandError(f"{flag} {text}: {err}") from None

    @staticmethod
    def _virtual_foreign(node: str, value: str | None, virtual_gpus: str | None, profile: VirtualProfile) -> dict:
        """Other tenants' use of the virtual GPUs, checked against them before anything starts."""
        flag = "--virtual-foreign" if value is not None else FOREIGN_ENV
        spec = value if value is not None else os.environ.get(FOREIGN_ENV, "")
        if not spec.strip():
            return {}
        try:
            devices = declared_virtual_gpus(node, virtual_gpus or settings.GPUPORTAL_VIRTUAL_GPUS, profile)
            foreign = parse_virtual_foreign(spec, len(devices))
        except ValueError as err:
            raise CommandError(f"{flag} {spec}: {err}") from None
        for index, bytes_ in foreign.items():
            if bytes_ > devices[index].total_bytes:
                raise CommandError(
                    f"{flag} {spec}: other tenants cannot hold {bytes_} bytes of virtual GPU {index}, "
                    f"which has {devices[index].total_bytes} bytes to allocate"
                )
        return foreign


def without_database() -> None:
    """No database for this process: settings fall back to a local default when DATABASE_URL is
    unset, and an agent that reached it by mistake would pass unnoticed. Any use now raises,
    naming why (gpuportal.no_database)."""
    connections.close_all()
    connections.settings = connections.configure_settings({"default": {"ENGINE": NO_DATABASE}})
    # Only those already opened: with the node's apps alone (gpuportal.node_process) none is.
    for connection in connections.all(initialized_only=True):
        del connections[connection.alias]
