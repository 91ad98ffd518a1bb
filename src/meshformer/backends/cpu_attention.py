"""The CPU backend's causal attention: query blocks of plain batched matmuls, what a compiled CPU training step runs
instead of SDPA (models/attention.py `causal_attention` asks `runs_blocked` and calls `checkpointed_attention`).

torch's CPU flash-attention kernel (what `F.scaled_dot_product_attention(is_causal=True)` runs on a CPU) reaches
about a third of the matmul peak in fp32 and a tenth of it in bf16 (bench/cpu_kernels.py, docs/benchmarks.md): its
backward is a scalar-heavy loop, and it gains nothing from bf16. `blocked_causal_attention` computes the same
attention in blocks of query rows with batched matmuls: block i's queries score against keys 0 .. end of block i
only (the blocks above the diagonal are skipped, as flash skips them), the softmax runs in fp32 and its
probabilities are rounded to the input dtype before they meet v, as flash rounds them. Inductor fuses each block's
element-wise work (scale, mask, softmax and their backward) into a few kernels.

`checkpointed_attention` runs it under activation checkpointing, which decides what backward keeps. On short rows
(`keeps_probabilities`) a selective checkpoint keeps the blocks' fp32 probabilities and the matmuls' outputs and
recomputes only the element-wise work around them (masks, casts, the copies of q and k slices the matmuls read):
backward then runs no matmul twice. Without any checkpoint Inductor's partitioner would choose what to keep itself,
and it keeps those slice copies too. On long rows, where the probabilities grow with the square of the row, a plain
checkpoint keeps only q, k and v and backward recomputes the blocks: flash attention's trade.

GQA: the query heads that share a key/value head are stacked along the rows of one matmul ([groups * block,
head_dim] against [keys, head_dim]): keys and values are never repeated. Packed rows (SFT packing) pass their
document mask, which replaces the causal one block by block. A sliding window (models/attention.py `window_band`'s
convention: the query at i sees the keys i - window < j <= i) also skips whole key blocks left of it; attention
sinks (GPT-OSS) join each row's softmax as one more column of value zero.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshformer.backends.torch_private import quiet_selective_checkpoint_notice, softmax_op

# At most this many query blocks: the loop unrolls into the compiled graph, whose size (and compile time) grows with
# it; 16 blocks skip 47% of the score matmuls (flash's causal skipping reaches 50%).
MAX_BLOCKS = 16
MIN_BLOCK = 64  # fastest on the CPU measured: 32 leaves the matmuls too small, 128 skips fewer scores
# Backward keeps the probabilities while they take at most this many times q, k and v's bytes: rows up to about
# 10 x head_dim in bf16 (twice that in fp32). Past it the kept bytes would grow with the row's square.
KEEP_PROBABILITIES_UP_TO = 4
# What the selective checkpoint keeps: the softmax's fp32 output (its own backward and the values' gradient read it)
# and the batched matmuls' outputs (so none runs again).
KEPT_OPS = frozenset({softmax_op(), torch.ops.aten.bmm.default})


def runs_blocked(q: torch.Tensor) -> bool:
    """Whether causal attention over `q` runs the blocked kernel: a plain CPU tensor in a compiled graph. Eager, its
    element-wise passes over the scores are not fused and it is no faster than flash; on GPUs (whose flash kernels
    are fast) and on DTensors, SDPA runs."""
    return q.device.type == "cpu" and torch.compiler.is_compiling() and type(q) is torch.Tensor


def checkpointed_attention(
    q, k, v, mask=None, scale=None, window=None, sinks=None, keep_probabilities: bool = True
) -> torch.Tensor:
    """`blocked_causal_attention` (its own block size) under a non-reentrant checkpoint: a selective one keeping the
    probabilities where `keeps_probabilities`, else a plain one keeping q, k and v (module docstring).
    keep_probabilities=False: the plain one always, for a layer recomputed from outside (parallel/recompute.py),
    where a kept probability would outlive the recompute's forward: the selective policy's must-save wins over
    the enclosing layer's recompute in the compiled graph, so every layer's probabilities would stay."""
    keep = keep_probabilities and keeps_probabilities(q, k, v, window)
    context = {"context_fn": _keep_probabilities_context} if keep else {}
    return torch.utils.checkpoint.checkpoint(
        blocked_causal_attention, q, k, v, 0, mask, scale, window, sinks, use_reentrant=False, **context
    )


def keeps_probabilities(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> bool:
    """Whether backward keeps the blocks' fp32 probabilities: while they take at most KEEP_PROBABILITIES_UP_TO
    times q, k and v's bytes."""
    b, h, s, _ = q.shape
    block = _block_size(s)
    scores = 0
    for i0 in range(0, s, block):
        i1 = min(i0 + block, s)
        scores += (i1 - i0) * (i1 - _first_key(i0, window))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    return b * h * scores * 4 <= KEEP_PROBABILITIES_UP_TO * inputs


def _keep_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_keep_probabilities_context = partial(create_selective_checkpoint_contexts, _keep_policy)
quiet_selective_checkpoint_notice()


def _block_size(s: int) -> int:
    """Query rows per block: MIN_BLOCK, raised so that there are at most MAX_BLOCKS."""
    return max(MIN_BLOCK, -(-s // MAX_BLOCKS))


def _first_key(i0: int, window: int | None) -> int:
    """The first key a block starting at query i0 scores: the first its first query sees under the window."""
    return 0 if window is None else max(0, i0 - window + 1)


def blocked_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int = 0,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q and k [b, heads / kv_heads, s, d], v [b, kv_heads, s, dv] -> [b, heads, s, dv] (laid out [b, s, heads, dv],
    as the flash kernel lays its output, so that merging the heads is a view); causal, scale 1/sqrt(d) unless given
    (latent attention's values are narrower than its keys, and YaRN changes its scale).
    block: query rows per block (0: MIN_BLOCK, raised so that there are at most MAX_BLOCKS).
    mask: [b, 1, s, s], True where a query may attend (packed documents: `llama.document_layout`); it must be
    causal itself, since the keys after each block are skipped.
    window: the sliding window (None: global): key blocks left of a block's first query's window are skipped too.
    sinks: [heads] logits joining each row's softmax as a column of value zero (module docstring)."""
    b, h, s, d = q.shape
    kv, dv = k.shape[1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = h // kv
    block = block or _block_size(s)
    acc = torch.promote_types(q.dtype, torch.float32)
    outs = []
    for i0 in range(0, s, block):
        i1 = min(i0 + block, s)
        n = i1 - i0
        k0 = _first_key(i0, window)
        rows = q[:, :, i0:i1].reshape(b, kv, g * n, d)  # the group's heads stacked: one matmul per kv head
        scores = torch.matmul(rows, k[:, :, k0:i1].transpose(-1, -2)).to(acc) * scale
        if window is not None:
            band = _window_band(i0, i1, k0, window, q.device)
            allowed = band.repeat(g, 1) if mask is None else (mask[:, :, i0:i1, k0:i1] & band).repeat(1, 1, g, 1)
        elif mask is None:
            allowed = torch.ones(n, i1, dtype=torch.bool, device=q.device).tril(i0).repeat(g, 1)  # keys <= query
        else:
            allowed = mask[:, :, i0:i1, :i1].repeat(1, 1, g, 1)  # the group's rows: the same mask each
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # row r of a kv head's stack is query head kv_head * g + r // n
            column = sinks.to(acc).view(1, kv, g, 1, 1).expand(b, kv, g, n, 1).reshape(b, kv, g * n, 1)
            probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1].to(v.dtype)
        else:
            probs = torch.softmax(scores, -1).to(v.dtype)
        outs.append(torch.matmul(probs, v[:, :, k0:i1]).reshape(b, h, n, dv).transpose(1, 2))
    return torch.cat(outs, 1).transpose(1, 2)


def _window_band(i0: int, i1: int, k0: int, window: int, device) -> torch.Tensor:
    """[i1 - i0, i1 - k0] True where query i0 + r may see key k0 + c under the window: k0 + c <= i0 + r and
    i0 + r - window < k0 + c (models/attention.py `window_band` on these positions; the tests hold them equal)."""
    queries, keys = torch.arange(i0, i1, device=device), torch.arange(k0, i1, device=device)
    return (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - window)
