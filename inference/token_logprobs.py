"""The log probabilities of the tokens an answer was made of, for a request that asks for them
(OpenAI's `logprobs`): each token's, and its `k` likeliest alternatives', as the model gave them
(the log-softmax of its logits, before temperature, penalties or any cut: as vLLM reports them by
default), whatever the sampling then picked. The paged engine (inference.batching) and
transformers' generate() path (inference.serving) both compute them here, and both hand them to
the web in one shape (`entries`), which it turns into OpenAI's (scheduling.api.openai_compat)."""

from __future__ import annotations

from typing import Any

# What a token's entry holds: its token id, its log probability, and the likeliest alternatives
# (token id, log probability), likeliest first.
Picked = tuple[int, float, list[tuple[int, float]]]


def of_rows(logits: Any, tokens: list[int], tops: list[int]) -> list[Picked]:
    """Each row's picked token (`tokens`) with its log probability and its `tops[i]` likeliest
    alternatives, from the rows of `logits` (a tensor of rows by vocabulary): one log-softmax for
    them all, read back at once."""
    import torch

    with torch.inference_mode():
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        index = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
        chosen = logprobs.gather(1, index).squeeze(1).tolist()
        most = max(tops, default=0)
        if most:
            values, ids = torch.topk(logprobs, most, dim=-1)
            best = list(zip(ids.tolist(), values.tolist(), strict=True))
        else:
            best = [([], [])] * len(tokens)
    return [
        (token, lp, list(zip(ids[:k], values[:k], strict=True)))
        for token, lp, (ids, values), k in zip(tokens, chosen, best, tops, strict=True)
    ]


def entries(tokenizer: Any, picked: list[Picked]) -> list[dict[str, Any]]:
    """The picks as the web reads them: each token's text (as it decodes alone), its log
    probability, and its alternatives as [text, log probability] pairs."""

    def text(token: int) -> str:
        return tokenizer.decode([token])

    return [
        {"token": text(token), "logprob": lp, "top": [[text(alt), alt_lp] for alt, alt_lp in top]}
        for token, lp, top in picked
    ]


def prompt_entries(tokenizer: Any, prompt: list[int], picked: list[Picked]) -> list[dict[str, Any]]:
    """An echoed prompt's tokens as the web reads them: the first has no log probability (nothing
    comes before it; OpenAI's null), each after it its picks' (`picked`, one per token after the
    first)."""
    first = {"token": tokenizer.decode(prompt[:1]), "logprob": None, "top": None}
    return [first, *entries(tokenizer, picked)] if prompt else []


def of_prompt(model: Any, ids: Any, top: int) -> list[Picked]:
    """Each token of `ids` ([1, tokens]) after the first with its log probability given those
    before it and its `top` likeliest alternatives, from one forward of the whole prompt: the
    generate() path's (the paged engine scores a prompt as it fills its cache)."""
    import torch

    with torch.inference_mode():
        logits = model(ids, use_cache=False).logits[0, :-1]
    tokens = ids[0, 1:].tolist()
    return of_rows(logits, tokens, [top] * len(tokens)) if tokens else []
