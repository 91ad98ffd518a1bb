"""Causal attention in query blocks of plain matmuls: what a compiled CPU training step runs instead of SDPA.

torch's CPU flash-attention kernel (what `F.scaled_dot_product_attention(is_causal=True)` runs on a CPU) reaches
about a third of the matmul peak in fp32 and a tenth of it in bf16 (bench/cpu_kernels.py): its backward is a
scalar-heavy loop, and it gains nothing from bf16. `blocked_causal_attention` computes the same attention in blocks
of query rows with batched matmuls: block i's queries score against keys 0 .. end of block i only (the blocks above
the diagonal are skipped, as flash skips them), the softmax runs in fp32 and its probabilities are rounded to the
input dtype before they meet v, as flash rounds them. Inductor fuses each block's element-wise work (scale, mask,
softmax and their backward) into a few kernels.

`causal_attention` runs it under activation checkpointing: only q, k and v are kept for backward, which recomputes
the blocks (no [seq, seq] scores survive the forward, and the compiled graph's partitioner cannot choose to keep
them, as it does without the checkpoint). Forward + backward of the bench_vs_hf shape (8 x 8 heads x 256 x 64) on
the AVX-512 BF16 EPYC: fp32 21.7 ms against flash's 24.8, bf16 14.8 against 28.3 (docs/benchmarks.md).

GQA: the query heads that share a key/value head are stacked along the rows of one matmul ([groups * block,
head_dim] against [keys, head_dim]): keys and values are never repeated. Packed rows (SFT packing) pass their
document mask, which replaces the causal one block by block.

Two building blocks a family may set per layer (models/llama/model.py `Attention.window` / `.sinks`):
- a sliding window: the query at position i attends the keys j with i - window < j <= i (`window_band`), the
  window's `window` latest keys counting its own; the blocked kernel also skips whole key blocks left of it;
- attention sinks (GPT-OSS): a learned logit per head that joins every query row's softmax as one more column whose
  value is zero, so a row may put weight on "nothing". SDPA has no sinks argument and torch's CPU flash kernel
  returns its log-sum-exp without a gradient (torch 2.13), so `sdpa` adds the sink as one more key instead: the
  queries gain a channel holding sink / scale, every key a 0 there and the sink key a 1 (its score is the sink, for
  every query, under GQA too: it is shared by the key heads), with a zero value. Exact, and gradients reach q, k, v
  and the sinks through the kernel's own backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

BLOCKED_ON_CPU = True  # False: SDPA everywhere (bench/cpu_kernels.py flips it to time both in one process)
# At most this many query blocks: the loop unrolls into the compiled graph, whose size (and compile time) grows with
# it; 16 blocks skip 47% of the score matmuls (flash's causal skipping reaches 50%).
MAX_BLOCKS = 16
MIN_BLOCK = 64  # fastest on the CPU measured: 32 leaves the matmuls too small, 128 skips fewer scores


def window_band(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, k] True where the query at position queries[i] may see the key at position keys[j]: j <= i and, with a
    window, i - window < j. transformers 5.x's convention (masking_utils `sliding_window_causal_mask_function`:
    `kv_idx > q_idx - window` and `kv_idx <= q_idx`, its window argument named as ours; Mistral, Gemma 3 and
    GPT-OSS build their masks with it): a query sees `window` keys, itself included."""
    causal = keys[None, :] <= queries[:, None]
    return causal if window is None else causal & (keys[None, :] > queries[:, None] - window)


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
    window: the sliding window (`window_band`; None: global): key blocks left of a block's first query's window are
    skipped too. sinks: [heads] logits joining each row's softmax as a column of value zero (module docstring)."""
    b, h, s, d = q.shape
    kv, dv = k.shape[1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = h // kv
    block = block or max(MIN_BLOCK, -(-s // MAX_BLOCKS))
    acc = torch.promote_types(q.dtype, torch.float32)
    outs = []
    for i0 in range(0, s, block):
        i1 = min(i0 + block, s)
        n = i1 - i0
        k0 = 0 if window is None else max(0, i0 - window + 1)  # the first key the block's first query sees
        rows = q[:, :, i0:i1].reshape(b, kv, g * n, d)  # the group's heads stacked: one matmul per kv head
        scores = torch.matmul(rows, k[:, :, k0:i1].transpose(-1, -2)).to(acc) * scale
        if window is not None:
            band = window_band(torch.arange(i0, i1, device=q.device), torch.arange(k0, i1, device=q.device), window)
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


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Causal self-attention over whole rows (training, a prompt's prefill): q [b, heads, s, d], k and v
    [b, kv_heads, s, d] (v may be narrower); mask: a causal [b, 1, s, s] (packed documents) or None; scale: of q.k
    (None: 1/sqrt(d)); window: a sliding window (`window_band`) on top of the mask; sinks: [heads] sink logits.
    Compiled on a CPU: the blocked
    kernel above, checkpointed. Eager (its element-wise passes over the scores are not fused there, and it is no
    faster than flash) and on GPUs (whose flash kernels are fast): torch's SDPA."""
    if BLOCKED_ON_CPU and q.device.type == "cpu" and torch.compiler.is_compiling() and type(q) is torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            blocked_causal_attention, q, k, v, 0, mask, scale, window, sinks, use_reentrant=False
        )
    if window is not None and window < q.shape[2]:  # a window as long as the row is the causal mask
        positions = torch.arange(q.shape[2], device=q.device)
        band = window_band(positions, positions, window)
        mask = band if mask is None else mask & band
    return sdpa(q, k, v, mask, scale, is_causal=mask is None, sinks=sinks)


def with_sink_key(q, k, v, mask, scale, is_causal: bool, sinks: torch.Tensor):
    """(q, k, v, mask, scale) of the same attention with the sinks [heads] as one more key (the module docstring):
    the last key, allowed for every query, whose score is its head's sink and whose value is zero."""
    b, h, s, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sink_channel = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, s, 1)
    q = torch.cat([q, sink_channel], -1)
    sink_key = torch.zeros(*k.shape[:2], 1, d + 1, dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1
    k = torch.cat([F.pad(k, [0, 1]), sink_key], 2)
    v = F.pad(v, [0, 0, 0, 1])
    if mask is None and is_causal:
        mask = torch.ones(s, k.shape[2] - 1, dtype=torch.bool, device=q.device).tril()
    if mask is not None:  # the sink's column: allowed (True, or 0 in an additive mask)
        allowed = torch.ones_like(mask[..., :1]) if mask.dtype == torch.bool else torch.zeros_like(mask[..., :1])
        mask = torch.cat([mask, allowed], -1)
    return q, k, v, mask, scale


def sdpa(q, k, v, mask=None, scale=None, is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """torch's SDPA (grouped heads when k has fewer), values narrower than the queries padded on a CPU: its flash
    kernel wants them as wide, and for narrower ones (latent attention's values) SDPA would run its math kernel,
    which keeps the [s x keys] probabilities for backward. sinks: [heads] sink logits (`with_sink_key`)."""
    width = v.shape[-1]
    if sinks is not None:
        q, k, v, mask, scale = with_sink_key(q, k, v, mask, scale, is_causal, sinks)
        is_causal = False
    if q.device.type == "cpu" and width < q.shape[-1]:
        v = F.pad(v, [0, q.shape[-1] - width])
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, scale=scale)
    return out[..., :width] if out.shape[-1] != width else out


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Position of every token within its document: [batch, seq] indices -> [batch, seq], 0 where one starts."""
    idx = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
