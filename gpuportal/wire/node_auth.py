"""A node's credential as both planes see it: the token's form and its hash, how an agent finds
its own token, and the words of a refusal. The control plane keeps only the hash
(scheduling.services.node_credentials); the agent sends the token with every call
(gpuportal.wire.control). Django-free."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

# Recognisable in a log, a secret scanner or a paste: a node token, not an API token.
TOKEN_PREFIX = "gpn_"
TOKEN_ENV = "GPUPORTAL_NODE_TOKEN"
# A file holding the token (a Kubernetes Secret mounted into the agent's pod, `up`'s 0600 file):
# read at start, so the token never shows in the process's environment or command line.
TOKEN_FILE_ENV = "GPUPORTAL_NODE_TOKEN_FILE"
# What a refused call's error begins with, so that the agent tells a refusal from a failure.
REFUSED = "node credential refused"
# Node names, as the agent's --node and the API accept them: a host's name as Kubernetes and the
# clouds give it (`ip-10-0-1-2.ec2.internal`), nothing that is special in a Redis ACL pattern, a
# URL path or a queue's name.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NODE_NAME_RULE = "use letters, digits, '.', '-' and '_', starting with a letter or digit, at most 100"


def node_name_problem(name: str) -> str | None:
    """Why `name` cannot name a node, or None when it can."""
    return None if NODE_NAME.fullmatch(name) else f"{name!r} is not a valid node name: {NODE_NAME_RULE}"


class TokenError(ValueError):
    """The agent's token cannot be read (its file is missing, unreadable or empty)."""


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """The sha256 of the token, hex: what the books keep. A token is 256 random bits, so a plain
    hash is enough: there is nothing to guess that a slow hash would protect."""
    return hashlib.sha256(token.encode()).hexdigest()


def read_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """The agent's token: GPUPORTAL_NODE_TOKEN, else the file GPUPORTAL_NODE_TOKEN_FILE names;
    None when neither is set (a portal that runs its node credentials `open` may accept that)."""
    token = environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = environ.get(TOKEN_FILE_ENV, "").strip()
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
        mode = stat.S_IMODE(Path(path).stat().st_mode)
    except OSError as err:
        raise TokenError(f"{TOKEN_FILE_ENV}={path}: {err.strerror or err}") from None
    if not token:
        raise TokenError(f"{TOKEN_FILE_ENV}={path} is empty")
    if mode & 0o004:
        # Told, not refused: a group may be meant to read it (Kubernetes mounts it 0440), and an
        # agent that would not start is worse than one that says so.
        log.warning(
            "%s=%s is readable by every user of this host (mode %04o): whoever reads it can speak for the "
            "node; `chmod 600` it (or 640, for a group of its own)",
            TOKEN_FILE_ENV,
            path,
            mode,
        )
    return token


def refusal(why: str) -> str:
    return f"{REFUSED}: {why}"


def is_refusal(error: str) -> bool:
    """Whether an answer's error (as gpuportal.wire.replies hands it on: "call: error") is a
    refusal of the node's credential."""
    return error.startswith(REFUSED) or f": {REFUSED}: " in error
