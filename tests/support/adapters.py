"""LoRA adapters as users have them: trained (here, made at random) and saved by PEFT."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from peft import LoraConfig, PeftModel, get_peft_model

# An adapter on attention only, with B random (PEFT's zeros would change nothing), large enough
# to change a tiny model's greedy answers.
SQL = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def write_adapter(model: Any, config: LoraConfig, path: Path, seed: int) -> Path:
    """A LoRA adapter of `model` (left as it is), saved by PEFT at `path`."""
    import torch

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), copy.deepcopy(config))
    with torch.no_grad():  # larger B than PEFT's random init, so that an adapter changes the greedy tokens
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(20)
    peft_model.save_pretrained(path)
    return path


def merged_greedy(model: Any, adapter: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy answer of PEFT's model with `adapter` merged into `model`'s weights."""
    import torch

    merged = PeftModel.from_pretrained(copy.deepcopy(model), adapter).merge_and_unload().eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = merged.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()
