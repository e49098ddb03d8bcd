"""`manage.py make_tiny_model DIR`: a randomly initialised causal LM with its tokenizer, for demos and tests.

No hub is reachable from the nodes or from CI, so there is no real checkpoint to deploy; this writes
one that loads and generates exactly like one (Llama architecture, safetensors weights, a fast
byte-level BPE tokenizer trained here on a built-in text), sized to the megabytes asked for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

MiB = 1024**2
FLOAT32_BYTES = 4
HEAD_DIM = 64
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<pad>", "<s>", "</s>")

# Enough varied English for the BPE trainer to learn a few hundred merges; what the model says with
# random weights is noise anyway, the tokenizer only has to round-trip text.
_CORPUS = """
gpuportal lets many models share a pool of GPUs. It places each model replica on the fraction of a
GPU it needs, puts idle replicas to sleep with their weights parked in CPU memory, and wakes them on
demand. When memory is short it preempts fairly: a replica that has served for its minimum runtime
may be evicted for one that has waited too long, but a popular replica never is. Each replica runs in
its own process, so a crash stays local and the memory cap applies to that process alone.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly
quick daft zebras jump. Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.
Hello, world! Hello there. What is the capital of France? Paris is the capital of France. Once upon
a time there was a small model that dreamed of generating text. It read every token it could find,
one at a time, and each morning it predicted the next one a little better than the day before.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048. Symbols: ( ) [ ] { } < > = + - * /
"""


@dataclass(frozen=True)
class TinyModel:
    path: Path
    weights_bytes: int
    parameters: int
    layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int


class Command(BaseCommand):
    help = (
        "Write a randomly initialised causal LM (Llama architecture, safetensors; float32 unless --dtype) with a "
        "working tokenizer to DIR, sized to about --size-mb MiB of weights. For demos and tests: no hub needed."
    )

    def add_arguments(self, parser):
        parser.add_argument("dir", help="Directory to write the model to (created if missing).")
        parser.add_argument("--size-mb", type=float, default=20.0, help="Weights size in MiB (default 20).")
        parser.add_argument("--seed", type=int, default=0, help="Random seed for the weights (default 0).")
        parser.add_argument(
            "--dtype",
            choices=WEIGHT_DTYPES,
            default="float32",
            help="The dtype the weights are stored in; --size-mb counts them in it (default float32).",
        )
        parser.add_argument("--force", action="store_true", help="Write into DIR even if it is not empty.")

    def handle(self, *args, dir: str, size_mb: float, seed: int, force: bool, dtype: str, **options):
        if not size_mb > 0:
            raise CommandError(f"--size-mb must be positive, got {size_mb}")
        path = prepare_dir(Path(dir), force=force)
        model = write_tiny_model(path, size_mb=size_mb, seed=seed, dtype=dtype, log=self.stdout.write)
        self.stdout.write(
            self.style.SUCCESS(
                f"wrote {model.path}: {model.weights_bytes / MiB:.1f} MiB of {dtype} weights "
                f"({model.parameters:,} parameters)"
            )
        )


def prepare_dir(path: Path, *, force: bool = False) -> Path:
    """Create `path` if needed; CommandError in one line when it cannot hold the model."""
    if path.exists() and not path.is_dir():
        raise CommandError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise CommandError(f"{path} exists and is not empty (use --force to write into it anyway)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(f"cannot create {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CommandError(f"{path} is not writable")
    return path


def write_tiny_model(
    path: Path,
    *,
    size_mb: float = 20.0,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> TinyModel:
    """Write the model and tokenizer to an existing, writable `path`: `size_mb` MiB of weights in
    `dtype`. `device`: where the random weights are drawn (a GPU draws gigabytes in moments, where
    a CPU takes a minute); what is written is the same kind of checkpoint either way."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(WEIGHT_DTYPES)})")
    element = getattr(torch, dtype)
    element_bytes = torch.empty(0, dtype=element).element_size()
    log("training the tokenizer (byte-level BPE on a built-in text)")
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    layers, hidden, intermediate = size_llama(size_mb * MiB / element_bytes, vocab)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    log(f"building the model: {layers} layers, hidden {hidden}, intermediate {intermediate}, vocab {vocab}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(element).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    parameters = sum(p.numel() for p in model.parameters())
    log(f"saving to {path}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return TinyModel(
        path=path,
        weights_bytes=parameters * element_bytes,
        parameters=parameters,
        layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
    )


def build_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = VOCAB_SIZE):
    """A PreTrainedTokenizerFast with <s>, </s>, <pad> and <unk>, trained here on `corpus` (lines;
    the built-in text by default) to at most `vocab_size` tokens: no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Byte-level: every string encodes (no <unk> at all), and decoding gives the text back.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.split("\n") if corpus is None else corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=2048,
    )


def llama_parameters(layers: int, hidden: int, intermediate: int, vocab: int) -> int:
    """Parameters of a Llama without GQA and with an untied LM head."""
    attention = 4 * hidden * hidden  # q, k, v, o
    mlp = 3 * hidden * intermediate  # gate, up, down
    norms = 2 * hidden
    return 2 * vocab * hidden + layers * (attention + mlp + norms) + hidden


def size_llama(target_params: float, vocab: int) -> tuple[int, int, int]:
    """(layers, hidden, intermediate) with about `target_params` parameters.

    Hidden grows in whole heads while the usual 8/3 MLP ratio still fits; the MLP width then fills
    the rest, so the size lands within a few KiB of the target instead of jumping by whole heads.
    """
    mib_params = MiB / FLOAT32_BYTES
    layers = 2 if target_params <= 64 * mib_params else 4 if target_params <= 1024 * mib_params else 8

    def usual_mlp(hidden: int) -> int:
        return max(8, round(hidden * 8 / 3 / 8) * 8)

    hidden = HEAD_DIM
    while llama_parameters(layers, hidden + HEAD_DIM, usual_mlp(hidden + HEAD_DIM), vocab) <= target_params:
        hidden += HEAD_DIM
    room = target_params - llama_parameters(layers, hidden, 0, vocab)
    intermediate = max(8, int(room / (3 * hidden * layers)) // 8 * 8)
    return layers, hidden, intermediate
