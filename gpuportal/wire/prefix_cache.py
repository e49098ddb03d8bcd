"""Whose requests share a replica's prefix cache (inference.kvpool): a scope every kept block's
digest begins with, so that a prompt finds only the blocks of prompts in its own scope.

A user's requests share with that user's own, not with another's: the K/V of a prompt is what
its caller wrote, and a hit shows (in `cached_tokens`, in a faster first token) that someone sent
those tokens before; across users that would tell one what another asked. The portal's user (the
token's) is the scope, as OpenAI scopes its prompt cache to an organization; vLLM's `cache_salt`
narrows it further, for a service that serves many people through one token. No Django here:
the web checks a salt, the replica scopes by it.
"""

from __future__ import annotations

import hashlib
from typing import Any

# vLLM's request field: requests share cached blocks only with those of the same salt (and user).
CACHE_SALT = "cache_salt"
MAX_SALT_CHARS = 256

# A deployment's `memory.prefix_cache`: whose requests share (a user's own, the default; every
# user's, for a team whose users send one system prompt and trust each other), or none at all.
USER, SHARED, OFF = "user", "shared", "off"
MODES = (USER, SHARED, OFF)


def salt_problem(value: Any) -> str | None:
    """Why `value` is no cache salt (None where it is one, or where none was given)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > MAX_SALT_CHARS:
        return f"at most {MAX_SALT_CHARS} characters"
    return None


def scope(owner: str, salt: str | None = None, mode: str = USER) -> bytes:
    """The scope of a request of `owner` with `salt` on a deployment of `mode`: equal for equal
    pairs, and different for any other (each part's length goes in with it, so that no two pairs
    read alike); where every user shares (SHARED), the salt's alone."""
    parts = [(owner if mode == USER else "").encode(), (salt or "").encode()]
    joined = b"".join(len(part).to_bytes(4, "big") + part for part in parts)
    return hashlib.blake2b(joined, digest_size=16).digest()
