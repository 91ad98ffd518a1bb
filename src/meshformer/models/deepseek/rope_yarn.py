"""Rotary embedding of latent attention: the decoupled rotary part (qk_rope_head_dim wide), optionally YaRN-scaled.

YaRN as transformers computes it (modeling_rope_utils `_compute_yarn_parameters`, `yarn_get_mscale`,
`yarn_apply_mscale`): the inverse frequencies blend interpolated (divided by `factor`) and original ones along a
linear ramp between the correction dimensions of `beta_fast` and `beta_slow` rotations over the original context
(rounded outwards), and cos/sin are multiplied by the attention factor mscale(factor, mscale) /
mscale(factor, mscale_all_dim) when both are given, else mscale(factor) = 0.1 ln(factor) + 1. DeepSeek also scales
the softmax of every q.k by mscale(factor, mscale_all_dim)^2 (`softmax_scale`). `rope_scaling.mscale` 0 stands for
"not given" in a config.json (the attention factor is then mscale(factor)).

Layout: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... (V2 by complex multiplication, V3
with `rope_interleave`); `rotate` de-interleaves the pairs at run time (evens, then odds) and applies the half-split
rotation, as transformers' `apply_rotary_pos_emb_interleave` does. The rotated vector comes out de-interleaved: the
rotary part only ever meets another rotary part in a dot product, so the order is immaterial as long as queries and
keys share it.
"""

from __future__ import annotations

import math

import torch

from meshformer.config.schema import ModelConfig
from meshformer.models.llama.model import RopeTables, apply_rotary


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 mscale ln(factor) + 1 (1 for no extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(mc: ModelConfig) -> bool:
    return mc.rope_scaling.type == "yarn"


def softmax_scale(mc: ModelConfig) -> float:
    """The factor of q.k before the softmax: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = mc.qk_head_dim**-0.5
    rs = mc.rope_scaling
    if _yarn(mc) and rs.mscale_all_dim:
        scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
    return scale


def attention_factor(mc: ModelConfig) -> float:
    """What cos/sin are multiplied by (1 without YaRN)."""
    if not _yarn(mc):
        return 1.0
    rs = mc.rope_scaling
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def inv_freq(mc: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary part [qk_rope_head_dim / 2], in float32 as transformers computes them."""
    d, base = mc.qk_rope_head_dim, mc.theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    if not _yarn(mc):
        return 1.0 / pos_freqs
    rs = mc.rope_scaling

    def correction_dim(rotations: float) -> float:
        return (d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of each frequency kept as it was
    return (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def mla_cos_sin(mc: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len, qk_rope_head_dim] (frequencies repeated twice, the half-split layout), times the attention
    factor."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq(mc).to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = attention_factor(mc)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


class MlaRopeTables(RopeTables):
    """Llama's position tables (slicing, per-row positions, generation past seq_length) over the rotary part only."""

    width_of = staticmethod(lambda mc: mc.qk_rope_head_dim)
    cos_sin = staticmethod(mla_cos_sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [batch, heads, seq, qk_rope_head_dim] rotated; interleaved pairs are de-interleaved first."""
    if interleaved:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return apply_rotary(x, cos, sin)
