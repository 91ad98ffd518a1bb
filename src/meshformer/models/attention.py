"""Causal attention as the models call it: torch's SDPA with the building blocks a family sets per layer, or on a
compiled CPU step the CPU backend's blocked kernel (backends/cpu_attention.py: the kernel and when it runs).

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

from meshformer.backends import cpu_attention


def window_band(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, k] True where the query at position queries[i] may see the key at position keys[j]: j <= i and, with a
    window, i - window < j. transformers 5.x's convention (masking_utils `sliding_window_causal_mask_function`:
    `kv_idx > q_idx - window` and `kv_idx <= q_idx`, its window argument named as ours; Mistral, Gemma 3 and
    GPT-OSS build their masks with it): a query sees `window` keys, itself included."""
    causal = keys[None, :] <= queries[:, None]
    return causal if window is None else causal & (keys[None, :] > queries[:, None] - window)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    keep_probabilities: bool = True,
):
    """Causal self-attention over whole rows (training, a prompt's prefill): q [b, heads, s, d], k and v
    [b, kv_heads, s, d] (v may be narrower); mask: a causal [b, 1, s, s] (packed documents) or None; scale: of q.k
    (None: 1/sqrt(d)); window: a sliding window (`window_band`) on top of the mask; sinks: [heads] sink logits.
    On a compiled CPU step the CPU backend's blocked kernel under a checkpoint (backends/cpu_attention.py
    `runs_blocked`; keep_probabilities=False: one that keeps only q, k and v, `recomputed_causal_attention`), else
    `sdpa_causal_attention`."""
    if cpu_attention.runs_blocked(q):
        return cpu_attention.checkpointed_attention(q, k, v, mask, scale, window, sinks, keep_probabilities)
    return sdpa_causal_attention(q, k, v, mask, scale, window, sinks)


def recomputed_causal_attention(q, k, v, mask=None, scale=None, window=None, sinks=None):
    """`causal_attention` for a layer recomputed from outside (parallel/recompute.py installs it as the layer's
    `attend`): on a compiled CPU step its blocked kernel keeps nothing past the layer's own recompute."""
    return causal_attention(q, k, v, mask, scale, window, sinks, keep_probabilities=False)


def sdpa_causal_attention(q, k, v, mask=None, scale=None, window=None, sinks=None) -> torch.Tensor:
    """`causal_attention` through torch's SDPA on every device (eager, on GPUs, and what bench/cpu_kernels.py
    compiles to time against the blocked kernel): the window as a banded mask on top of `mask`."""
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
