"""The bytes an `MoEBlock` (layer.py) saves for backward, in closed form, for the planner.

The routing is data-dependent (how many rows each expert gets), which a forward on fake tensors cannot run, so
the planner's counter (planner/counted_activations.py) counts everything else of a family's layer on its real
modules and takes the MoE block's bytes from here. Without capacity drops every token's k choices are computed,
so the totals below do not depend on how the tokens spread over the experts. Per micro-batch of T tokens, k
choices (R = T k routed rows), E experts of width F, shared experts of width S, element sizes r (the residual
stream's, which the routed experts compute in), a (compute dtype) and s (the router's scores):

    router      its input (a copy: autocast's, or the fp32 copy of a narrower stream), the scores T E s, the
                gate weights T k s (renormalised: the gathered scores, their sum T s and the result, 2 T k + T)
    routed      the rows R h r (a copy under autocast: the experts cast their input), gate, silu, up and their
                product 4 R F r, the rows back in their token slots R h r (the weighted sum keeps them)
    shared      4 T S a (as a dense SwiGLU), their input's autocast copies; Qwen2-MoE's sigmoid gate adds its
                input copy, T a and the shared output T h a
The post-attention norm's output, which router, experts and shared experts all read, is counted here once when
nobody copies it. Selective recompute keeps the router's logits, the shared experts' matmul outputs and, where
parallel/recompute.py keeps grouped matmuls, the experts' three outputs (2 R F + R h). Expert parallelism moves
rows between ranks but keeps R rows per rank on average (an even load; an uneven one is the imbalance metric).
tests/test_moe_plan.py holds this to a real step's measured bytes.
"""

from __future__ import annotations


def moe_block_bytes(mc, tokens: int, residual: int, compute: int, autocast: bool) -> tuple[int, int]:
    """(bytes saved for backward, bytes kept under selective recompute) of one MoE block for `tokens` tokens, with
    everything in it training."""
    m = mc.moe_config
    T, h, E, k = tokens, mc.hidden_size, m.expert_num, m.num_experts_chosen
    F, S = mc.expert_ffn_size, mc.shared_ffn_size
    R = T * k
    copies = autocast or residual < 4  # the router's linear reads a copy (autocast's, or .float()'s)
    s = compute if autocast else 4  # autocast runs the router's linear and softmax in the compute dtype
    x_in = 0 if copies else T * h * residual  # the norm's output, shared by every reader
    router = (T * h * (compute if autocast else 4) if copies else 0) + T * E * s
    router += (2 * T * k + T) * s if m.norm_topk_prob and k > 1 else T * k * s
    routed = R * h * residual + 4 * R * F * residual + R * h * residual
    if autocast and residual != compute:
        routed += T * k * 4  # the gate weights cast to the experts' dtype for the weighted sum
    shared = 0
    if S:
        shared += 4 * T * S * compute + (2 * T * h * compute if autocast else 0)
        if m.shared_expert_gate:
            shared += (T * h * compute if autocast else 0) + T * compute + T * h * compute
    saved = x_in + router + routed + shared
    kept = T * E * s + (2 * T * S + T * h) * compute if S else T * E * s
    if _grouped_mm_kept():
        kept += (2 * R * F + R * h) * residual
    return saved, kept


def _grouped_mm_kept() -> bool:
    from meshformer.backends.torch_private import grouped_mm_op
    from meshformer.parallel.recompute import SAVED_OPS

    return grouped_mm_op() in SAVED_OPS
