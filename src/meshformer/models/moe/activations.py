"""The bytes an `MoEBlock`'s routed experts (layer.py `_routed`, experts.py) save for backward, in closed form.

The routing is data-dependent (how many rows each expert gets), which a forward on fake tensors cannot run, so
the planner's counter (planner/counted_activations.py) runs the block's router and shared experts on fake tensors,
counted like any module (their inputs or autocast's copies, the fp32 router's scores and gate weights, LoRA,
frozen weights), and takes the routed part from here. Without capacity drops every token's k choices are
computed, so the total does not depend on how the tokens spread over the experts. Per micro-batch of T tokens, k
choices (R = T k rows), hidden h, experts of width F, element size e of the experts' dtype (autocast's, or the
stream's):

    rows        the R dispatched rows as the experts compute them, R h e (a cast copy under autocast), saved by
                the gate and up matmuls for their weight gradients: only when the experts train
    experts     gate output (silu's input), silu and up output (their product's inputs) 3 R F e, and the product
                R F e (the down matmul's input, for its weight gradient: only when the experts train); the clamped
                SwiGLU (expert_activation) saves 6 R F e instead of 3: both clamps' inputs, the sigmoid's output,
                the clamped gate, up + 1 and the gated product (measured on the block)
    weights     autocast's copies of the experts' weights, 3 E F h e for the E experts of this rank, when they are
                stored wider than e (no data parallelism gathers them in the compute dtype): saved for the input
                gradients, one copy per micro-batch (the cast is explicit: autocast's cache does not hold it)
    combine     the rows back in their token slots R h e and the gate weights T k e (the weighted sum's inputs)

Selective recompute keeps the three grouped matmuls' outputs (2 R F + R h) e where parallel/recompute.py keeps
grouped matmuls, and under expert parallelism what its two all-to-alls return (collectives are not re-run),
2 R h r in the stream's dtype r (the rows are cast after they arrive). Expert parallelism keeps R rows per rank on
average (an even load; an uneven one is the imbalance metric). tests/unit/test_moe_plan.py holds the block and the
planner to real steps.
"""

from __future__ import annotations


def routed_bytes(
    mc, tokens: int, stream: int, experts: int, trains: bool, weight_copies: bool, ep: int, matmuls_kept: bool
) -> tuple[int, int]:
    """(bytes saved for backward, bytes kept under selective recompute) of one MoE block's routed experts for
    `tokens` tokens: `stream` and `experts` are the element sizes of the residual stream and of the experts'
    compute, `trains` whether the experts' weights train, `weight_copies` whether each forward casts them,
    `matmuls_kept` whether the recompute policy keeps the grouped matmuls' outputs (the planner asks it)."""
    m = mc.moe_config
    T, h, E, k, F = tokens, mc.hidden_size, m.expert_num, m.num_experts_chosen, mc.expert_ffn_size
    R = T * k
    glu = 6 if m.expert_activation == "clamped_swiglu" else 3  # tensors of R x F the gated activation saves
    saved = (R * h if trains else 0) + (glu + 1 if trains else glu) * R * F + R * h + T * k
    if weight_copies:
        saved += 3 * (E // ep) * F * h
    kept = (2 * R * F + R * h) * experts if matmuls_kept else 0
    if ep > 1:
        kept += 2 * R * h * stream  # the rows received for this rank's experts, and the rows sent back
    return saved * experts, kept
