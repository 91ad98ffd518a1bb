"""The MoE block against references: grouped-matmul experts against the per-expert loop, the block against
transformers' own MoE modules with the same weights, capacity drops against a brute-force reference."""

from __future__ import annotations

import math

import pytest
import torch

from meshformer.config import load_config
from meshformer.models.moe import MoEBlock
from meshformer.models.moe.balance import capacity_keep
from meshformer.models.moe.experts import grouped_experts, looped_experts
from meshformer.models.moe.router import RouterOutput

M = "model.model_config."


def moe_config(**moe):
    over = {M + "type": "Qwen3MoeConfig", M + "hidden_size": 32, M + "num_layers": 2, M + "num_heads": 4}
    over |= {M + "intermediate_size": 64, M + "vocab_size": 64, M + "seq_length": 16}
    over |= {f"{M}moe_config.{k}": v for k, v in moe.items()}
    args = [a for k, v in over.items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]
    return load_config(None, args).model.model_config


def _expert_inputs(dtype, counts, hidden=32, ffn=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, rows = len(counts), sum(counts)
    x = torch.randn(rows, hidden, generator=g)
    gate, up = (torch.randn(e, ffn, hidden, generator=g) * 0.2 for _ in range(2))
    down = torch.randn(e, hidden, ffn, generator=g) * 0.2
    return [t.to(dtype).requires_grad_() for t in (x, gate, up, down)], torch.tensor(counts)


def _run(fn, tensors, counts, dy):
    out = fn(tensors[0], counts, *tensors[1:])
    grads = torch.autograd.grad(out, tensors, dy)
    return out.detach(), grads


# Experts 1 and 4 receive no rows: their weights' gradients must be exact zeros in both paths.
COUNTS = [5, 0, 17, 3, 0, 9]


def test_grouped_experts_equal_the_loop_fp32_forward_and_backward():
    tensors, counts = _expert_inputs(torch.float32, COUNTS)
    dy = torch.randn(sum(COUNTS), 32, generator=torch.Generator().manual_seed(1))
    ref, ref_g = _run(looped_experts, tensors, counts, dy)
    out, g = _run(grouped_experts, tensors, counts, dy)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for w in g[1:]:
        assert w[1].abs().max() == 0 and w[4].abs().max() == 0


def test_grouped_experts_equal_the_loop_bf16_within_bf16_rounding():
    """Both bf16 paths accumulate in fp32 but round their inputs and every intermediate (h, its gradient) to bf16,
    in a different order of operations: each differs from the fp32 result by a few bf16 roundings. The bound: the
    error of one bf16 matmul of reduction length K is about eps x sqrt(K) relative to the result's scale (random
    rounding errors add up like a random walk); the two paths chain three matmuls, so allow 4 x eps x sqrt(K_max)
    of the fp32 result's largest magnitude between them, and check each against fp32 by the same bound."""
    counts = [16, 0, 32, 8, 0, 16]
    t32, c = _expert_inputs(torch.float32, counts, ffn=64)
    dy32 = torch.randn(sum(counts), 32, generator=torch.Generator().manual_seed(1))
    ref, ref_g = _run(looped_experts, t32, c, dy32)
    tb = [t.detach().to(torch.bfloat16).requires_grad_() for t in t32]
    dyb = dy32.to(torch.bfloat16)
    loop, loop_g = _run(looped_experts, tb, c, dyb)
    grouped, grouped_g = _run(grouped_experts, tb, c, dyb)
    eps = torch.finfo(torch.bfloat16).eps
    for got_l, got_g, want in zip((loop, *loop_g), (grouped, *grouped_g), (ref, *ref_g)):
        k = max(64, sum(counts))  # the longest reduction: ffn (forward, input grads) or rows (weight grads)
        bound = 4 * eps * math.sqrt(k) * want.abs().max().item()
        assert (got_g.float() - got_l.float()).abs().max().item() <= bound
        assert (got_g.float() - want).abs().max().item() <= bound
        assert (got_l.float() - want).abs().max().item() <= bound


def _hf_block(kind: str, seed: int):
    """A transformers MoE block with random weights, and the config our MoEBlock builds the same layer from."""
    tf = pytest.importorskip("transformers")
    common = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4}
    if kind == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)
        block = tf.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(cfg)
        ours = moe_config(expert_num=8, num_experts_chosen=2, moe_intermediate_size=24, norm_topk_prob=True)
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3)
        cfg.norm_topk_prob = False
        block = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
        ours = moe_config(expert_num=8, num_experts_chosen=3, moe_intermediate_size=24, norm_topk_prob=False)
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            **common, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=2
        )
        cfg.norm_topk_prob = True
        block = tf.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(cfg)
        ours = moe_config(
            expert_num=8, num_experts_chosen=2, moe_intermediate_size=24, shared_expert_num=1,
            shared_expert_intermediate_size=40, shared_expert_gate=True, norm_topk_prob=True,
        )  # fmt: skip
    elif kind == "deepseek_v2":  # softmax, groups by their best expert, no renormalisation, two shared experts
        cfg = tf.DeepseekV2Config(
            **common, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
            topk_method="group_limited_greedy", n_shared_experts=2, routed_scaling_factor=1.5, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        )  # fmt: skip
        block = tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(cfg)
        ours = moe_config(
            expert_num=16, num_experts_chosen=4, moe_intermediate_size=16, shared_expert_num=2, n_group=4,
            topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5, norm_topk_prob=False,
        )  # fmt: skip
    else:  # deepseek_v3: sigmoid scores, a score-correction bias, group-limited top-k, a scaled, shared expert
        cfg = tf.DeepseekV3Config(
            **common, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        )  # fmt: skip
        block = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(cfg)
        ours = moe_config(
            expert_num=16, num_experts_chosen=4, moe_intermediate_size=16, shared_expert_num=1, n_group=4,
            topk_group=2, topk_method="noaux_tc", use_gating_sigmoid=True, routed_scaling_factor=2.5,
        )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "gate.weight" in name else 0.2))
        if kind == "deepseek_v3":  # negative biased scores too: a masked group's fill value matters
            block.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3 - 0.8)
    return block.float(), ours


def _copy_into_ours(block, hf, kind: str) -> None:
    e = hf.experts
    gate, up = e.gate_up_proj.detach().chunk(2, dim=1)
    with torch.no_grad():
        block.experts.gate_proj.copy_(gate)
        block.experts.up_proj.copy_(up)
        block.experts.down_proj.copy_(e.down_proj)
        block.gate.weight.copy_(hf.gate.weight)
        if block.gate.e_score_correction_bias is not None:
            block.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        shared = getattr(hf, "shared_experts", None) or getattr(hf, "shared_expert", None)
        if shared is not None:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(block.shared_experts, name).weight.copy_(getattr(shared, name).weight)
        if block.shared_expert_gate is not None:
            block.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("use_gmm", [True, False])
def test_moe_block_equals_transformers_block(kind, use_gmm):
    hf, mc = _hf_block(kind, seed=3)
    mc.moe_config.use_gmm = use_gmm
    ours = MoEBlock(mc, 0)
    _copy_into_ours(ours, hf, kind)
    x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(4))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = hf(x_ref)
    got = ours(x_ours)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(want)
    (gw,) = torch.autograd.grad(want, x_ref, dy)
    (go,) = torch.autograd.grad(got, x_ours, dy)
    torch.testing.assert_close(go, gw, rtol=1e-5, atol=1e-5)


def _brute_force_keep(indices, weights, num_experts, factor):
    """Per expert: its (token, choice) pairs ranked by weight descending, then token, then choice; keep the first
    ceil(factor x tokens x k / experts)."""
    n, k = indices.shape
    cap = math.ceil(factor * n * k / num_experts)
    keep = torch.zeros(n, k)
    for e in range(num_experts):
        pairs = [(t, j) for t in range(n) for j in range(k) if indices[t, j] == e]
        pairs.sort(key=lambda p: (-weights[p].item(), p[0], p[1]))
        for p in pairs[:cap]:
            keep[p] = 1.0
    return keep


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
def test_capacity_keeps_the_highest_weights_per_expert_like_brute_force(factor):
    g = torch.Generator().manual_seed(5)
    n, k, e = 40, 2, 6
    logits = torch.randn(n, e, generator=g) * 2
    logits[:, 0] += 1.5  # expert 0 overloaded
    indices = logits.topk(k, dim=-1).indices
    weights = logits.softmax(-1).gather(1, indices)
    weights[3, 0] = weights[7, 0] = weights[9, 0]  # ties are broken by token order
    route = RouterOutput(logits, logits.softmax(-1), indices, weights)
    keep = capacity_keep(route, e, factor)
    torch.testing.assert_close(keep, _brute_force_keep(indices, weights, e, factor))
    cap = math.ceil(factor * n * k / e)
    per_expert = torch.zeros(e).index_add_(0, indices.reshape(-1), keep.reshape(-1))
    assert per_expert.max() <= cap
    assert capacity_keep(route, e, None) is None


def test_dropped_pairs_contribute_nothing_and_are_counted():
    mc = moe_config(expert_num=4, num_experts_chosen=2, moe_intermediate_size=16, capacity_factor=0.5)
    block = MoEBlock(mc, 1)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(2, 8, 32, generator=g)
    out = block(x)
    flat = x.reshape(-1, 32)
    route = block.gate(flat)
    keep = capacity_keep(route, 4, 0.5)
    assert 0 < (keep == 0).sum() and block.stats.dropped.item() == (keep == 0).sum().item()
    e = block.experts
    want = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            ex = route.indices[t, j]
            y = torch.nn.functional.silu(flat[t] @ e.gate_proj[ex].T) * (flat[t] @ e.up_proj[ex].T) @ e.down_proj[ex].T
            want[t] += keep[t, j] * route.weights[t, j] * y
    torch.testing.assert_close(out.reshape(-1, 32), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_gmm", [True, False])
def test_under_bf16_autocast_the_router_stays_fp32_and_the_experts_run_bf16(use_gmm):
    mc = moe_config(expert_num=4, num_experts_chosen=2, moe_intermediate_size=16, use_gmm=use_gmm)
    block = MoEBlock(mc, 1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(2, 8, 32, generator=g)
    seen = {}
    block.gate.register_forward_hook(lambda m, a, out: seen.update(logits=out.logits.dtype))
    block.experts.register_forward_hook(lambda m, a, out: seen.update(experts=out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x)
    assert seen == {"logits": torch.float32, "experts": torch.bfloat16}
    ref = block(x)  # fp32: bf16 experts differ by their rounding (2^-8 relative per product), not more
    assert (out.float() - ref).abs().max() <= 0.02 * ref.abs().max()
