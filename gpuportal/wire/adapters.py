"""LoRA adapters served beside their base model: a deployment's `model.adapters` names them
(`sql=/srv/adapters/sql,chat=hf:org/chat-lora`), each a PEFT LoRA directory its replicas load
with the base, and a request reaches one through the model id `deployment:adapter`, as vLLM
serves `--lora-modules` under names of their own. Dozens of fine-tunes of one base then cost
one copy of the base's weights and a few MiB each, in one batch (inference.lora).

The syntax and the model id, Django-free: the API's input, the CLI, the replica and the node
that reads an adapter's size all read them here."""

from __future__ import annotations

import re

# An adapter's name, as a deployment's (a slug) with '.' too: `sql`, `chat-v2`, `qwen.math`.
NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,62}[A-Za-z0-9])?")
# Between a deployment's name and its adapter's in a model id: `llama-8b:sql`. No deployment's
# name (a slug) holds one, so the id reads one way only, as Ollama's `model:tag` does.
SEPARATOR = ":"
MAX_ADAPTERS = 32
MAX_TEXT = 4_000
RULE = "`name=source,...` (PEFT LoRA directories; names letters, digits, '.', '_', '-')"
# The request parameter the replica reads: the adapter's name, absent for the base model.
PARAM = "adapter"


def parse(text: str) -> dict[str, str]:
    """`name=source,name=source` as {name: source}, in the order given ("" is none); ValueError
    naming what is wrong."""
    if len(text) > MAX_TEXT:
        raise ValueError(f"at most {MAX_TEXT} characters, got {len(text)}")
    named: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, equals, source = (side.strip() for side in item.partition("="))
        if not equals or not source:
            raise ValueError(f"{item!r} must be name=source (a PEFT LoRA directory, or hf:org/name)")
        if not NAME.fullmatch(name):
            raise ValueError(
                f"adapter name {name!r} must be letters, digits, '.', '_' or '-', starting and ending with a "
                "letter or digit, at most 64"
            )
        if name in named:
            raise ValueError(f"adapter {name!r} is named twice")
        if "\x00" in source:
            raise ValueError(f"adapter {name!r}: its source must not contain a NUL character")
        named[name] = source
    if len(named) > MAX_ADAPTERS:
        raise ValueError(f"at most {MAX_ADAPTERS} adapters, got {len(named)}")
    return named


def canonical(text: str) -> str:
    """The text as stored: `name=source` pairs, comma-separated, in the order given."""
    return written(parse(text))


def written(named: dict[str, str]) -> str:
    """{name: source} as the text stores it (parse's inverse)."""
    return ",".join(f"{name}={source}" for name, source in named.items())


def split_model(model: str) -> tuple[str, str | None]:
    """(deployment, adapter) of a model id: `llama-8b:sql` → ("llama-8b", "sql"); a plain name
    has no adapter."""
    deployment, separator, adapter = model.partition(SEPARATOR)
    return (deployment, adapter) if separator else (model, None)


def model_id(deployment: str, adapter: str) -> str:
    return f"{deployment}{SEPARATOR}{adapter}"
