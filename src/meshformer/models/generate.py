"""Autoregressive text generation with the model's KV cache, one prompt or a left-padded batch.

The prompt is run once (prefill) into a cache sized for prompt + new tokens; after that each step feeds
only the newest token. `generate_stream` yields each token as it is sampled (the CLI prints text as it comes).
Sampling follows the usual order: temperature, then top-k, then top-p (nucleus).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypedDict, Unpack

import torch


class Sampling(TypedDict, total=False):
    """How each new token is drawn: the keywords of `generate`, `generate_batch` and `generate_stream` (defaults:
    plain sampling at temperature 1, no top-k or top-p, no stop token, torch's global generator)."""

    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # 0: off
    greedy: bool
    eos_id: int | Iterable[int] | None  # a row stops after emitting one (included in its tokens)
    generator: torch.Generator | None  # seeded: reproducible sampling


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


def _check(prompts: list[list[int]], temperature: float, top_p: float, top_k: int) -> None:
    if not prompts or any(not ids for ids in prompts):
        raise ValueError("generate: every prompt must contain at least one token")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"generate: top_p={top_p} must be in [0, 1]")
    if top_k < 0:
        raise ValueError(f"generate: top_k={top_k} must be >= 0 (0: off)")


def _as_ids(prompt: list[int] | torch.Tensor) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        return torch.as_tensor(prompt, dtype=torch.long).flatten().tolist()
    return [int(t) for t in prompt]


def batch_steps(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    eos_id: int | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[list[int | None]]:
    """Yield each step's new token per row (None for a row already done) until every row is done.

    A generator, so `generate_stream` hands out tokens as they are sampled; the model's training mode is restored
    when it ends or is closed early.
    """
    prompts = [_as_ids(p) for p in prompts]
    _check(prompts, temperature, top_p, top_k)
    if max_new_tokens <= 0:
        return
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts)
    tokens = torch.tensor([[p[0]] * (longest - len(p)) + p for p in prompts], device=device)
    documents = None
    if any(len(p) < longest for p in prompts):
        pad = torch.tensor([longest - len(p) for p in prompts], device=device)
        documents = (torch.arange(longest, device=device)[None, :] >= pad[:, None]).long()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # around each model call, so grad mode never leaks into the caller between yields
            cache = model.new_kv_cache(len(prompts), longest + max_new_tokens)
            logits = model(tokens, cache, documents)[:, -1]
        counts = [0] * len(prompts)
        done = [False] * len(prompts)
        while True:
            step: list[int] = []
            emitted: list[int | None] = []
            for r, row in enumerate(logits):
                tok = next_token(
                    row, temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, generator=generator
                )
                emitted.append(None if done[r] else tok)
                if not done[r]:
                    counts[r] += 1
                    done[r] = tok in stop or counts[r] == max_new_tokens
                step.append(tok)
            yield emitted
            if all(done):
                return
            with torch.no_grad():
                logits = model(torch.tensor(step, device=device)[:, None], cache)[:, -1]
    finally:
        model.train(was_training)


def generate_batch(
    model, prompts: list[list[int]], max_new_tokens: int, **sampling: Unpack[Sampling]
) -> list[list[int]]:
    """Continue several prompts at once; returns each prompt's new tokens.

    Prompts of different lengths are left-padded: the padding is a document of its own (models/llama.py), so
    each prompt attends only to itself and its rotary positions start at 0, as if it ran alone. A row stops after
    emitting an `eos_id` (included in its result); the batch stops when every row has, or after max_new_tokens.
    Rows sample in order from one `generator`, so a batch of one draws what `generate` draws.
    """
    out: list[list[int]] = [[] for _ in prompts]
    for emitted in batch_steps(model, prompts, max_new_tokens, **sampling):
        for row, tok in zip(out, emitted):
            if tok is not None:
                row.append(tok)
    return out


def generate_stream(
    model, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int, **sampling: Unpack[Sampling]
) -> Iterator[int]:
    """`generate`, one token at a time as each is sampled (the same tokens, the same draws from `generator`)."""
    for (tok,) in batch_steps(model, [_as_ids(prompt_ids)], max_new_tokens, **sampling):
        yield tok


def generate(
    model, prompt_ids: list[int] | torch.Tensor, max_new_tokens: int, **sampling: Unpack[Sampling]
) -> list[int]:
    """Continue `prompt_ids` by up to `max_new_tokens` tokens; returns the new tokens only.

    Stops early after emitting `eos_id` (or any of several, e.g. EOS and a chat turn's end; it is included in the
    result). temperature 0 means greedy.
    Pass a seeded `generator` for reproducible sampling.
    """
    return generate_batch(model, [_as_ids(prompt_ids)], max_new_tokens, **sampling)[0]


__all__ = [
    "Sampling",
    "batch_steps",
    "generate",
    "generate_batch",
    "generate_stream",
    "next_token",
    "top_k_filter",
    "top_p_filter",
]
