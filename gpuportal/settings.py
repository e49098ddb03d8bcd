"""Settings come from environment variables (docs/operating.md lists them); nothing here is per-machine."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from gpuportal import node_process
from gpuportal.stackenv import default_data_dir, resolve_stack_urls
from gpuportal.wire.control import AGENT_CALL_TASK, AGENT_QUEUE
from gpuportal.wire.states import DeploymentStatus

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def database_from_url(url: str) -> dict:
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ValueError(f"DATABASE_URL must be a postgres:// URL, got scheme {parts.scheme!r}")
    options: dict = dict(parse_qsl(parts.query))
    host = unquote(parts.hostname or "") or options.pop("host", "")
    # The ledger's hot statements run on server-binding cursors, which psycopg prepares after
    # this many runs (Django's own cursors bind on the client and are unaffected). Set it empty
    # behind a transaction-pooling proxy, where prepared statements do not survive.
    threshold = os.environ.get("GPUPORTAL_DB_PREPARE_THRESHOLD", "5")
    options["prepare_threshold"] = int(threshold) if threshold else None
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "gpuportal",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(parts.port or ""),
        "OPTIONS": options,
        "CONN_MAX_AGE": int(os.environ.get("GPUPORTAL_CONN_MAX_AGE", "60")),
        "CONN_HEALTH_CHECKS": True,
    }


STACK_URLS = resolve_stack_urls(os.environ)
# A node agent opens none of it, given or not: it reaches the control plane through Redis alone
# (gpuportal.management.commands.agent).
DATABASE_URL = STACK_URLS.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpuportal")
REDIS_URL = STACK_URLS.get("REDIS_URL", "redis://127.0.0.1:6379/0")

DEBUG = env_bool("GPUPORTAL_DEBUG")
# A deployment sets GPUPORTAL_SECRET_KEY (docker/compose.yaml does), and `up` keeps one of its own
# in var/secret-key; this public default is only for one-off commands and the tests (a web
# server that runs with it says so when it starts: gpuportal.wsgi).
PUBLIC_SECRET_KEY = "gpuportal-dev-only-not-secret-8c1f7e2a9b"
SECRET_KEY = os.environ.get("GPUPORTAL_SECRET_KEY", PUBLIC_SECRET_KEY)
ALLOWED_HOSTS = [
    h.strip() for h in os.environ.get("GPUPORTAL_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h.strip()
]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in os.environ.get("GPUPORTAL_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "gpuportal",
    "scheduling",
    "inference",
]
if node_process.marked():
    INSTALLED_APPS = list(node_process.APPS)

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # A path with a NUL character (%00): a 400 before any view queries the database with it.
    "scheduling.api.bodies.PathGuard",
    # Serves the admin's and the API docs' static files under granian too (docker/compose.yaml).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # An unreachable PostgreSQL or Redis, or a body too big: a JSON answer naming it, not a 500.
    "scheduling.api.outages.OutageMiddleware",
    "gpuportal.throttle.AdminLoginThrottle",
]

ROOT_URLCONF = "gpuportal.urls"
WSGI_APPLICATION = "gpuportal.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(DATABASE_URL)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("GPUPORTAL_STATIC_ROOT", BASE_DIR / "var" / "static"))
# Without collectstatic (dev, `up`, tests) WhiteNoise finds files through the app finders, so
# an absent STATIC_ROOT is expected there; only images run collectstatic (docker/Dockerfile).
WHITENOISE_USE_FINDERS = True
warnings.filterwarnings("ignore", message="No directory at", category=UserWarning)

REST_FRAMEWORK = {
    # Token first: DRF answers anonymous requests with the first class's challenge, so 401 not 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "gpuportal.auth.CachedTokenAuthentication",
        "gpuportal.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "gpuportal.pagination.Pagination",
    # JSON nested past a limit, or a string with a NUL character: a 400 naming it, not a 500.
    "DEFAULT_PARSER_CLASSES": [
        "scheduling.api.bodies.GuardedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "scheduling.api.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "gpuportal API",
    "DESCRIPTION": "Share a pool of GPUs between many models: nodes, GPUs, deployments, replicas, events.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Served from the sidecar package: the portal's hosts may have no route to a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # An example for every operation, and a summary where a view has none.
    # One name for each set of choices that fields of several names (or several sets under one
    # name) share: a client generated from the schema gets ReplicaStateEnum, not State55dEnum.
    "ENUM_NAME_OVERRIDES": {
        "ReplicaStateEnum": "scheduling.models.Replica.State",
        "DeploymentStatusEnum": [status.value for status in DeploymentStatus],
        "PullStateEnum": "gpuportal.wire.pulls.STATES",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "scheduling.api.examples.add_examples",
    ],
}

# Celery: Redis is broker and result store; control-plane work defaults to the `control` queue,
# node work goes to each node's own queue (see inference.agent).
CELERY_BROKER_URL = REDIS_URL
# Kombu's Redis transport, less what lets a node that writes to a queue stop or steer its reader.
CELERY_BROKER_TRANSPORT = "gpuportal.broker:Transport"
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_DEFAULT_QUEUE = "control"
# The agents' calls have a worker of their own (gpuportal.wire.control).
CELERY_TASK_ROUTES = {AGENT_CALL_TASK: {"queue": AGENT_QUEUE}}
CELERY_TASK_ACKS_LATE = True
# No worker takes remote-control commands (shutdown, revoke, pool restart): they come over Redis
# Pub/Sub with no credential, which every node's Redis user may publish to. The portal sends none.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_EXPIRES = 3600
CELERY_TIMEZONE = "UTC"
# django-celery-beat's schedules, sent only by the beat that holds the beat lock in Redis: a
# second beat (a rollout's overlap, a stray process) waits rather than sending every sweep twice.
CELERY_BEAT_SCHEDULER = "scheduling.beat_lock:LockedDatabaseScheduler"
# How long the beat lock outlives its holder's last renewal (it renews on every tick, at least
# every third of this): after a beat dies, how long before a waiting one takes over.
GPUPORTAL_BEAT_LOCK_TTL_S = env_float("GPUPORTAL_BEAT_LOCK_TTL_S", 15.0)

# Node liveness: agents beat every HEARTBEAT_S; a node silent for HEARTBEAT_TIMEOUT_S is offline.
GPUPORTAL_HEARTBEAT_S = env_float("GPUPORTAL_HEARTBEAT_S", 5.0)
# How long a deploy waits for a node agent to read the model's files (gpuportal.wire.inspection).
GPUPORTAL_INSPECT_TIMEOUT_S = env_float("GPUPORTAL_INSPECT_TIMEOUT_S", 60.0)
# While no node has answered, the next online node is asked as well this often (a node's worker
# may be busy): long enough that a node importing torch for a factory's first reading answers.
GPUPORTAL_INSPECT_HEDGE_S = env_float("GPUPORTAL_INSPECT_HEDGE_S", 15.0)
GPUPORTAL_HEARTBEAT_TIMEOUT_S = env_float("GPUPORTAL_HEARTBEAT_TIMEOUT_S", 20.0)
# A gap this long between two heartbeat sweeps (they run every 5 s) means the control plane itself
# stalled (PostgreSQL frozen, Redis down, its worker restarting) and heard no node meanwhile: node
# silence counts only from the sweep after it (scheduling.core.liveness).
GPUPORTAL_CONTROL_STALL_S = env_float("GPUPORTAL_CONTROL_STALL_S", 10.0)
# `up` starts a process that died again after a backoff that doubles per restart in ten minutes,
# up to this (gpuportal.up): a helper that keeps crashing is retried for as long as `up` runs.
GPUPORTAL_RESTART_BACKOFF_MAX_S = env_float("GPUPORTAL_RESTART_BACKOFF_MAX_S", 30.0)
# A pending replica whose process the node's agent still does not run this long after it was
# placed: its start command was lost (a broker that blinked as the placement committed), and the
# next heartbeat sends it again (scheduling.services.lost_commands.resend_lost_starts).
GPUPORTAL_START_GRACE_S = env_float("GPUPORTAL_START_GRACE_S", 60.0)
# Likewise for the other commands, each seen from the state the agent reports of the replica's
# process. A replica still waking this long after its promotion
# while its process still sleeps (or serves: its `woken` report was lost) is sent its wake again;
# longer than GPUPORTAL_EVICTION_WAIT_S (60 s), which a wake may spend waiting for its victims.
GPUPORTAL_WAKE_GRACE_S = env_float("GPUPORTAL_WAKE_GRACE_S", 120.0)
# A replica still draining this long beyond its deployment's drain timeout while its process still
# serves (or sleeps: its `sleeping` report was lost) is sent its sleep again.
GPUPORTAL_SLEEP_GRACE_S = env_float("GPUPORTAL_SLEEP_GRACE_S", 60.0)
# A replica still stopping this long beyond its drain timeout is sent its stop again if its process
# still runs; if the agent runs none, its `stopped` report was lost and is applied then.
GPUPORTAL_STOP_GRACE_S = env_float("GPUPORTAL_STOP_GRACE_S", 60.0)
# A replica loading, serving, asleep in its process or standing by whose process the node's agent
# no longer runs, unchanged this long: the process ended and its last report (`failed`) was lost,
# and it is applied then. Longer than a report waits for its answer (120 s), so that a report
# still on its way is never overtaken.
GPUPORTAL_END_GRACE_S = env_float("GPUPORTAL_END_GRACE_S", 150.0)
# A serving replica granted a host arena this long ago whose process still keeps none is sent the
# grant again; one whose arena was taken back this long ago, its process still keeping one, the
# drop. Longer than it takes to allocate and pin a large model's arena.
GPUPORTAL_ARENA_GRACE_S = env_float("GPUPORTAL_ARENA_GRACE_S", 120.0)
# A replica outlives its agent this long, waiting for the agent's next run to adopt it.
# At most the heartbeat timeout less two beats: the agent's last beat came at most a beat before it
# died, so an orphan nobody adopted has stopped (a beat's time for that) before its node is written
# off and its replacements placed. 0: replicas die with their agent.
_ADOPTION_LIMIT_S = max(0.0, GPUPORTAL_HEARTBEAT_TIMEOUT_S - 2 * GPUPORTAL_HEARTBEAT_S)
GPUPORTAL_ADOPTION_WINDOW_S = min(env_float("GPUPORTAL_ADOPTION_WINDOW_S", _ADOPTION_LIMIT_S), _ADOPTION_LIMIT_S)
# Whether node agents keep a warm spare on each GPU (inference.spare_pool): a replica process
# with its CUDA context made there, for the next replica started on that GPU (a deep sleeper's
# wake above all) to run in. Each costs one context per GPU, which placement leaves alone.
GPUPORTAL_WARM_SPARES = env_bool("GPUPORTAL_WARM_SPARES", False)
# Which agents fork their replicas from a template that has imported torch and the replica
# program once (inference.forkserver) rather than start each in a fresh interpreter (3-4 s of CPU
# less per start): `virtual`, those on virtual GPUs; `all`, those on NVIDIA GPUs too (the forked
# replica makes its own CUDA context; not yet the default there: it has yet to run on a GPU);
# `off`, none.
GPUPORTAL_REPLICA_FORKSERVER = os.environ.get("GPUPORTAL_REPLICA_FORKSERVER", "virtual").strip().lower() or "virtual"
if GPUPORTAL_REPLICA_FORKSERVER not in {"virtual", "all", "off"}:
    raise ValueError(
        f"GPUPORTAL_REPLICA_FORKSERVER must be 'virtual', 'all' or 'off', not {GPUPORTAL_REPLICA_FORKSERVER!r}"
    )
# Where the node's templates' service listens (`python -m inference.forkserver --listen PATH`), when it
# runs one: an agent that forks its replicas asks it for a template already imported rather than
# start its own (and starts its own when it does not answer). Empty: each agent starts its own.
GPUPORTAL_REPLICA_TEMPLATE_SOCKET = os.environ.get("GPUPORTAL_REPLICA_TEMPLATE_SOCKET", "").strip()
# Stopped and failed replicas are removed this long after they ended, but the newest
# GPUPORTAL_REPLICA_KEEP_ENDED of each deployment stay for their errors (their Events always stay).
GPUPORTAL_REPLICA_RETENTION_S = env_float("GPUPORTAL_REPLICA_RETENTION_S", 3600.0)
GPUPORTAL_REPLICA_KEEP_ENDED = int(os.environ.get("GPUPORTAL_REPLICA_KEEP_ENDED", "3"))
# The capacity planner's recorded traffic (scheduling.models.RequestRecord): ended requests are
# kept this long (7 days by default: `export_trace --since 7d`), then pruned by the drain task.
GPUPORTAL_REQUEST_RECORD_RETENTION_S = env_float("GPUPORTAL_REQUEST_RECORD_RETENTION_S", 7 * 86400.0)
# The books' tolerance (scheduling.core.books): a replica over its reservation, or a change of
# other tenants' use of a GPU, within the larger of this and 1 % of the figure shows in the gauges
# but records no Event and changes nothing.
GPUPORTAL_BOOKS_TOLERANCE_BYTES = int(os.environ.get("GPUPORTAL_BOOKS_TOLERANCE_BYTES", str(16 * 1024**2)))
# Commit path: attempts and the cap of the jittered backoff between them.
GPUPORTAL_CAS_ATTEMPTS = int(os.environ.get("GPUPORTAL_CAS_ATTEMPTS", "8"))
GPUPORTAL_CAS_BACKOFF_MAX_S = env_float("GPUPORTAL_CAS_BACKOFF_MAX_S", 0.05)
# Scale calls that arrive together in one process (the web's threads) commit together, in one
# transaction (scheduling.services.scaling); off: each in its own, as a caller's transaction does.
GPUPORTAL_SCALE_TOGETHER = env_bool("GPUPORTAL_SCALE_TOGETHER", True)
GPUPORTAL_DATA_DIR = str(default_data_dir())
GPUPORTAL_VIRTUAL_GPUS = os.environ.get("GPUPORTAL_VIRTUAL_GPUS", "2x24GiB")
# A replica's CUDA context is no setting: each GPU row holds its own, measured by its replicas
# (default: the H100's), and a virtual node's comes from its agent's --virtual-context.
# A replica that hits a CUDA device-side assert is restarted at most this many times per hour.
GPUPORTAL_MAX_RESTARTS_PER_HOUR = int(os.environ.get("GPUPORTAL_MAX_RESTARTS_PER_HOUR", "3"))
# Failed sign-ins (password or token) from one address, or for one user name, in a minute before
# a 429 (gpuportal.throttle).
GPUPORTAL_AUTH_FAILURES_PER_MINUTE = int(os.environ.get("GPUPORTAL_AUTH_FAILURES_PER_MINUTE", "10"))
# Each user's inference requests: at most this many accepted and not yet ended at once, and this
# many accepted per minute; beyond either, a 429 with Retry-After. 0: no limit. A user's row under
# "User limits" in the admin overrides either (scheduling.services.user_limits).
GPUPORTAL_USER_MAX_CONCURRENT = int(os.environ.get("GPUPORTAL_USER_MAX_CONCURRENT", "0"))
GPUPORTAL_USER_MAX_PER_MINUTE = int(os.environ.get("GPUPORTAL_USER_MAX_PER_MINUTE", "0"))
# How many replicas of one node load their weights at once (inference.load_slots); the rest wait
# their turn. Default: the host's CPU cores.
GPUPORTAL_MAX_LOADS_PER_NODE = int(os.environ.get("GPUPORTAL_MAX_LOADS_PER_NODE") or os.cpu_count() or 1)
# The host RAM a new replica's process is counted to take (scheduling.core.host_memory) until one
# of its deployment's has been measured: about what a process that imported torch holds.
GPUPORTAL_REPLICA_HOST_BYTES = int(os.environ.get("GPUPORTAL_REPLICA_HOST_BYTES", str(1024**3)))
# The most replicas one deployment may ask for (a scale of 256 started ~74 processes).
GPUPORTAL_MAX_REPLICAS = int(os.environ.get("GPUPORTAL_MAX_REPLICAS", "32"))
# How many revisions of each deployment's settings are kept for `gpuportal history` and a
# rollback (Kubernetes' revisionHistoryLimit, and its default); at least 2, so there is one to go back to.
GPUPORTAL_REVISIONS_KEPT = max(2, int(os.environ.get("GPUPORTAL_REVISIONS_KEPT", "10")))
# A `torch-module` source (package.module:factory) is code the nodes run: only the modules an
# operator lists here (comma-separated module prefixes, e.g. "acme.models") may be deployed.
GPUPORTAL_TORCH_MODULES = tuple(
    module.strip() for module in os.environ.get("GPUPORTAL_TORCH_MODULES", "").split(",") if module.strip()
)
# A request whose replica died is run again on another, at most this many times in all.
GPUPORTAL_REQUEST_ATTEMPTS = int(os.environ.get("GPUPORTAL_REQUEST_ATTEMPTS", "3"))
# /infer/ waits this long by default, and never longer than the maximum, before answering 202.
GPUPORTAL_INFER_TIMEOUT_S = env_float("GPUPORTAL_INFER_TIMEOUT_S", 30.0)
GPUPORTAL_INFER_MAX_TIMEOUT_S = env_float("GPUPORTAL_INFER_MAX_TIMEOUT_S", 300.0)
# How long a node waits for replicas evicted to make room to release their memory before loading.
GPUPORTAL_EVICTION_WAIT_S = env_float("GPUPORTAL_EVICTION_WAIT_S", 60.0)
# The time to first token the portal aims for: the idle sweep does not put to sleep on
# its timer a replica whose wake from CPU RAM alone takes longer (fairness.sleep_when_idle). The
# capacity planner's default SLO (scheduling/simulation/config.toml) is the same 5 s.
GPUPORTAL_TTFT_SLO_S = env_float("GPUPORTAL_TTFT_SLO_S", 5.0)
# How long a GPU's wake lock lasts unless its holder renews it: a waker that died (SIGKILL, a
# lost worker) stops renewing, and the next wake takes the lock over once this has passed.
GPUPORTAL_WAKE_LOCK_TTL_S = env_float("GPUPORTAL_WAKE_LOCK_TTL_S", 60.0)
# Host-to-device copy speed a woken replica's weights move at: what a fair wake weighs as the
# cost of reloading a victim (fairness.choose_victim's "cost" order).
GPUPORTAL_H2D_BYTES_PER_S = env_float("GPUPORTAL_H2D_BYTES_PER_S", 20e9)
# How long a token found valid is trusted again without a database look-up (gpuportal.auth).
GPUPORTAL_TOKEN_CACHE_S = env_float("GPUPORTAL_TOKEN_CACHE_S", 5.0)
# How long past that it is still trusted at once while a thread looks it up again: a frozen or
# restarting database does not hold up a request that needs nothing else from it.
GPUPORTAL_TOKEN_STALE_S = env_float("GPUPORTAL_TOKEN_STALE_S", 60.0)
# Node credentials (scheduling.services.node_credentials): `required`, every agent's call carries
# a valid token of its node; `open`, a node that was never issued one may call without (a node that
# has one must show it, and a revoked node is always refused).
GPUPORTAL_NODE_AUTH = os.environ.get("GPUPORTAL_NODE_AUTH", "required").strip().lower() or "required"
if GPUPORTAL_NODE_AUTH not in {"required", "open"}:
    raise ValueError(f"GPUPORTAL_NODE_AUTH must be 'required' or 'open', not {GPUPORTAL_NODE_AUTH!r}")
# Failover pairs (seed 004): a takeover's wake past its timeout ends the process; an active member
# silent past the liveness timeout is killed by its node agent.
GPUPORTAL_FAILOVER_WAKE_TIMEOUT_S = env_float("GPUPORTAL_FAILOVER_WAKE_TIMEOUT_S", 60.0)
GPUPORTAL_FAILOVER_LIVENESS_TIMEOUT_S = env_float("GPUPORTAL_FAILOVER_LIVENESS_TIMEOUT_S", 3.0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("GPUPORTAL_LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
