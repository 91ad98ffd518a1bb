"""Autoregressive text generation with the model's KV cache (batch of one).

The prompt is run once (prefill) into a cache sized for prompt + new tokens; after that each step feeds
only the newest token. Sampling follows the usual order: temperature, then top-k, then top-p (nucleus).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of the last dimension (k <= 0 or k >= vocab: keep all); others -> -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most probable tokens whose probability mass is >= p.

    A token is kept when the mass of the tokens ranked strictly above it is still < p, so the token that
    crosses p is included and the most probable token is always kept. p >= 1 keeps everything.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False  # even p == 0 keeps the argmax
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> int:
    """Pick one token id from a 1-D logits vector."""
    logits = logits.float()
    if greedy or temperature == 0:
        return int(torch.argmax(logits))
    logits = top_p_filter(top_k_filter(logits / temperature, top_k), top_p)
    probs = torch.softmax(logits, dim=-1)
    if generator is not None:  # multinomial needs the generator's device
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    eos_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue `prompt_ids` by up to `max_new_tokens` tokens; returns the new tokens only.

    Stops early after emitting `eos_id` (or any of several, e.g. EOS and a chat turn's end; it is included in the
    result). temperature 0 means greedy.
    Pass a seeded `generator` for reproducible sampling.
    """
    ids = (
        torch.as_tensor(prompt_ids, dtype=torch.long).flatten().tolist()
        if isinstance(prompt_ids, torch.Tensor)
        else [int(t) for t in prompt_ids]
    )
    if not ids:
        raise ValueError("generate: the prompt must contain at least one token")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"generate: top_p={top_p} must be in [0, 1]")
    if top_k < 0:
        raise ValueError(f"generate: top_k={top_k} must be >= 0 (0: off)")
    if max_new_tokens <= 0:
        return []
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        cache = model.new_kv_cache(1, len(ids) + max_new_tokens)
        logits = model(torch.tensor([ids], device=device), cache)[0, -1]
        out: list[int] = []
        while True:
            tok = next_token(
                logits, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, generator=generator
            )
            out.append(tok)
            if tok in stop or len(out) == max_new_tokens:
                return out
            logits = model(torch.tensor([[tok]], device=device), cache)[0, -1]
    finally:
        model.train(was_training)


__all__ = ["generate", "next_token", "top_k_filter", "top_p_filter"]
