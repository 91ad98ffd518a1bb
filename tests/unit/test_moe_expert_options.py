"""The MoE block's building blocks for expert biases, a router bias and the clamped SwiGLU (models/moe/): the grouped
and looped experts agree with biases and either activation (forward and backward, empty experts included), the
clamped activation is its formula, the router's bias moves its logits, and the defaults build no new parameter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshformer.models.moe import MoEBlock
from meshformer.models.moe.experts import GroupedExperts, grouped_experts, looped_experts
from test_moe_layer import COUNTS, moe_config


def _clamped(gate, up, alpha=1.702, limit=7.0):
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def _inputs(counts, hidden=32, ffn=48):
    g = torch.Generator().manual_seed(0)
    e, rows = len(counts), sum(counts)
    x = torch.randn(rows, hidden, generator=g) * 4  # wide enough that the clamp at 7 bites
    weights = [torch.randn(e, ffn, hidden, generator=g) * 0.5 for _ in range(2)]
    weights.append(torch.randn(e, hidden, ffn, generator=g) * 0.2)
    biases = [torch.randn(e, ffn, generator=g), torch.randn(e, ffn, generator=g), torch.randn(e, hidden, generator=g)]
    return [t.requires_grad_() for t in (x, *weights, *biases)], torch.tensor(counts)


def test_grouped_and_looped_experts_agree_with_biases_and_the_clamped_activation():
    experts = GroupedExperts(len(COUNTS), 32, 48, bias=True, activation="clamped_swiglu")
    tensors, counts = _inputs(COUNTS)
    dy = torch.randn(sum(COUNTS), 32, generator=torch.Generator().manual_seed(1))
    outs = []
    for fn in (looped_experts, grouped_experts):
        out = fn(tensors[0], counts, *tensors[1:], glu=experts.glu)
        outs.append((out.detach(), torch.autograd.grad(out, tensors, dy)))
    (ref, ref_g), (got, got_g) = outs
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ref_g[-1][1].abs().max() == 0 and ref_g[-1][4].abs().max() == 0  # empty experts: no bias gradient
    # expert 0's rows by hand: the biases where nn.Linear puts them, the clamped gate
    x, gate, up, down, gb, ub, db = (t.detach() for t in tensors)
    rows = x[: COUNTS[0]]
    want = F.linear(_clamped(F.linear(rows, gate[0], gb[0]), F.linear(rows, up[0], ub[0])), down[0], db[0])
    torch.testing.assert_close(ref[: COUNTS[0]], want)
    gate_pre = F.linear(x, gate[0], gb[0])
    assert gate_pre.max() > 7 and F.linear(x, up[0], ub[0]).min() < -7  # both clamps are exercised


def test_the_router_bias_moves_the_logits_and_the_defaults_add_no_parameter():
    plain = MoEBlock(moe_config(expert_num=4, num_experts_chosen=2), 1)
    assert plain.gate.bias is None and plain.experts.gate_bias is None
    assert plain.experts.weight_names() == ("gate_proj", "up_proj", "down_proj")
    mc = moe_config(expert_num=4, num_experts_chosen=2, router_bias=True, expert_bias=True)
    block = MoEBlock(mc, 1)
    names = sorted(n for n, _ in block.named_parameters())
    for want in ("gate.bias", "experts.gate_bias", "experts.up_bias", "experts.down_bias"):
        assert want in names
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(10, mc.hidden_size)
    with torch.no_grad():
        logits = block.gate(x).logits
        torch.testing.assert_close(logits, x @ block.gate.weight.T + block.gate.bias)


def test_families_without_these_options_refuse_to_export_them():
    import pytest

    from meshformer.errors import UserError
    from meshformer.models.registry import family_of

    for option in ("router_bias=True", "expert_bias=True", "expert_activation=clamped_swiglu"):
        key, value = option.split("=")
        mc = moe_config(expert_num=4, num_experts_chosen=2, **{key: value})
        with pytest.raises(UserError, match=key):
            family_of(mc).config_to_hf(mc, "float32")
