"""The Llama family's activation model: the bytes each decoder layer of models/llama/model.py saves for backward.

Closed-form arithmetic over the layer's operations (RMSNorm, GQA attention through SDPA, SwiGLU), in Korthikanti
et al.'s style: planner/memory.py's module docstring has the per-piece formulas, and tests/cli/test_memory.py and
tests/parity/test_parallel.py hold them to the bytes real runs measure. The planner reaches it as the family's
`activation_model` (models/activations.py says what it is asked).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.schema import ModelConfig
from meshformer.models.activations import (
    ActivationShape,
    HeadActivations,
    LayerActivations,
    PieceActivations,
    kept_matmul,
)


@dataclass
class LayerGrads:
    """Which pieces of a decoder layer train (the rest is frozen, e.g. by LoRA or freezing); LoRA ranks by linear."""

    norm1: bool = True
    q: bool = True
    k: bool = True
    v: bool = True
    o: bool = True
    norm2: bool = True
    gate: bool = True
    up: bool = True
    down: bool = True
    qk_norm: bool = True
    lora: dict | None = None  # linear name (q, k, ...) -> rank

    @classmethod
    def of(cls, layer) -> "LayerGrads":
        def trains(module) -> bool:
            return module is not None and any(p.requires_grad for p in module.parameters())

        attn, mlp = layer.self_attn, layer.mlp
        names = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
        names |= {"gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
        lora = {n: m.lora_A.out_features for n, m in names.items() if hasattr(m, "lora_A")}
        flags = {n: trains(m) for n, m in names.items()}
        return cls(
            trains(layer.input_layernorm),
            **flags,
            norm2=trains(layer.post_attention_layernorm),
            qk_norm=trains(attn.q_norm),
            lora=lora,
        )


def _norm_bytes(rows: int, width: int, n: int, grad_in: bool, weight_trains: bool) -> int:
    """What an RMSNorm keeps: its input and the rsqrt when a gradient flows to its input, the normalised value
    when its weight trains."""
    return (rows * width * n + rows * n if grad_in else 0) + (rows * width * n if weight_trains else 0)


def layer_activation_bytes(
    mc: ModelConfig,
    tokens: int,
    tp: int,
    sp: bool,
    dtypes: dict[str, int],
    casts: bool = False,
    g: LayerGrads | None = None,
    grad_in: bool = True,
) -> tuple[int, bool]:
    """(bytes one decoder layer saves for backward for `tokens` tokens (one micro-batch, no recompute), whether its
    output requires grad). A tensor is saved only when something needs it: a frozen linear keeps no input, a frozen
    norm no normalised value, and nothing before the first trainable piece keeps anything. `casts`: autocast
    narrows a wider residual stream, separately for each linear that keeps its input."""
    g = g or LayerGrads()
    T, h, f = tokens, mc.hidden_size, mc.ffn_hidden_size
    heads, kv_heads, hd = mc.num_heads, mc.num_kv_heads, mc.dim_per_head
    n, a = dtypes["norm"], dtypes["compute"]
    rows = T // tp if sp else T  # sequence parallel: norms see their sequence shard
    total = _norm_bytes(rows, h, n, grad_in, g.norm1)
    readers = sum((g.q, g.k, g.v))  # linears that keep the normalised input (a LoRA linear's A does)
    total += (readers if casts else min(readers, 1)) * T * h * a
    total += sum(T * r * a for r in (g.lora or {}).values())  # LoRA A's output, kept by B
    normed_grad = grad_in or g.norm1
    q_grad, k_grad, v_grad = normed_grad or g.q, normed_grad or g.k, normed_grad or g.v
    if mc.use_qk_norm:
        total += _norm_bytes(T * heads // tp, hd, n, q_grad, g.qk_norm)
        total += _norm_bytes(T * kv_heads // tp, hd, n, k_grad, g.qk_norm)
    qkv_grad = q_grad or k_grad or v_grad
    if qkv_grad:  # attention keeps q and k after rotary, v, its output and the log-sum-exp
        total += (2 * T * heads * hd + 2 * T * kv_heads * hd) * a // tp + 4 * T * heads // tp
    elif g.o:
        total += T * heads * hd * a // tp  # the output projection keeps the attention output
    mid_grad = qkv_grad or g.o
    total += _norm_bytes(rows, h, n, mid_grad, g.norm2)
    readers = sum((g.gate, g.up))
    total += (readers if casts else min(readers, 1)) * T * h * a
    mlp_grad = mid_grad or g.norm2 or readers > 0
    if mlp_grad:
        total += 3 * T * f * a // tp  # gate output (silu's input), silu's output and up's (the product's inputs)
    if g.down:
        total += T * f * a // tp  # the product, the down projection's input
    return total, mlp_grad or g.down


def split_backward_kept_bytes(
    mc: ModelConfig,
    tokens: int,
    tp: int,
    sp: bool,
    dtypes: dict[str, int],
    g: LayerGrads | None = None,
    grad_in: bool = True,
    mlp_kept: bool = True,
) -> int:
    """Bytes of one layer's saved tensors (no recompute) that outlive its weight-gradient action (W) on a pipeline
    stage other than the first, under the schedules that split backward (zero bubble, ZBV, DualPipeV). torch's W
    re-runs only the nodes between the weights and the `intermediates` it kept (torch.distributed.pipelining
    _backward.stage_backward_weight), freeing the matmuls' inputs and the norms' normalised values; the rest of the
    graph lives until the step ends: the norms' inputs and rsqrt, attention's q, k, v, output and log-sum-exp, and
    SwiGLU's element-wise inputs except in the last layer of a stage that sends its output on (measured, torch
    2.13: bench/planner_vs_measured.py)."""
    g = g or LayerGrads()
    T, h, f = tokens, mc.hidden_size, mc.ffn_hidden_size
    heads, kv_heads, hd = mc.num_heads, mc.num_kv_heads, mc.dim_per_head
    n, a = dtypes["norm"], dtypes["compute"]
    rows = T // tp if sp else T
    total = _norm_bytes(rows, h, n, grad_in, False)
    normed_grad = grad_in or g.norm1
    q_grad, k_grad, v_grad = normed_grad or g.q, normed_grad or g.k, normed_grad or g.v
    if mc.use_qk_norm:
        total += _norm_bytes(T * heads // tp, hd, n, q_grad, False)
        total += _norm_bytes(T * kv_heads // tp, hd, n, k_grad, False)
    qkv_grad = q_grad or k_grad or v_grad
    if qkv_grad:
        total += (2 * T * heads * hd + 2 * T * kv_heads * hd) * a // tp + 4 * T * heads // tp
    mid_grad = qkv_grad or g.o
    total += _norm_bytes(rows, h, n, mid_grad, False)
    if mlp_kept and (mid_grad or g.norm2 or g.gate or g.up):
        total += 3 * T * f * a // tp
    return total


def selective_layer_bytes(
    mc: ModelConfig,
    tokens: int,
    tp: int,
    sp: bool,
    a: int,
    residual: int,
    lora: dict | None = None,
    policy: str = "matmuls",
) -> int:
    """Bytes a selectively recomputed layer keeps (parallel/recompute.py's policy): its input, the matmul outputs
    `policy` keeps (counted in the order the layer runs them), attention's output and log-sum-exp, and the outputs
    of tensor-parallel collectives."""
    T, h, q = tokens, mc.hidden_size, mc.num_heads * mc.dim_per_head
    total = T * h * residual // (tp if sp else 1)  # the layer's input
    matmuls = [T * w * a for w in _matmul_widths(mc, tp, lora)]
    total += sum(b for i, b in enumerate(matmuls) if kept_matmul(policy, i))
    total += T * q * a // tp + 4 * T * mc.num_heads // tp  # attention output, log-sum-exp
    if tp > 1:  # all-gathers before attention and MLP + reduce-scatters after (SP), or two all-reduces
        # SP gathers the norms' outputs, in the residual stream's dtype: autocast casts them later, in the linears
        total += (2 * T * h * residual + 2 * T * h * a // tp) if sp else 2 * T * h * a
    return total


def _matmul_widths(mc: ModelConfig, tp: int, lora: dict | None) -> list[int]:
    """Output width of each matmul of a layer on one rank, in forward order: q, k, v, o, gate, up, down (o and
    down whole: partial sums before their reduction), each LoRA linear's A and B right after its base."""
    h, f = mc.hidden_size, mc.ffn_hidden_size
    q, kv = mc.num_heads * mc.dim_per_head, mc.num_kv_heads * mc.dim_per_head
    outs = {"q": q // tp, "k": kv // tp, "v": kv // tp, "o": h, "gate": f // tp, "up": f // tp, "down": h}
    widths = []
    for name, width in outs.items():
        widths.append(width)
        if name in (lora or {}):
            widths += [lora[name], width]
    return widths


class LlamaActivations:
    """The formulas above, per piece of the planner's cut (models/activations.py's ActivationModel)."""

    needs_styles = False  # the formulas know where this family's plan cuts

    def piece_activations(
        self, mc: ModelConfig, piece, shape: ActivationShape, grad_in: bool, sends_output: bool, styles: dict
    ) -> PieceActivations:
        T, tp, sp = shape.tokens, shape.tp, shape.sp
        dt = {"norm": shape.norm, "compute": shape.compute}
        layer_input = T * mc.hidden_size * shape.residual // (tp if sp else 1)
        layers, grad = {}, grad_in
        keys = list(piece.layers.keys())
        for i, key in enumerate(keys):
            g = LayerGrads.of(piece.layers[key])
            saved, grad_out = layer_activation_bytes(mc, T, tp, sp, dt, shape.casts, g, grad)
            last_sender = i == len(keys) - 1 and sends_output
            layers[key] = LayerActivations(
                saved=saved,
                grad_out=grad_out,
                full_recompute=layer_input if grad or grad_out else 0,
                selective=selective_layer_bytes(
                    mc, T, tp, sp, shape.compute, shape.residual, g.lora, shape.select_policy
                ),
                after_w=split_backward_kept_bytes(mc, T, tp, sp, dt, g, grad, not last_sender),
            )
            grad = grad_out
        head = None
        if getattr(piece, "norm", None) is not None:
            h, rows = mc.hidden_size, T // tp if sp else T
            out = piece.lm_head if piece.lm_head is not None else piece.embed_tokens
            head_trains = out is not None and any(p.requires_grad for p in out.parameters())
            norm_trains = any(p.requires_grad for p in piece.norm.parameters())
            saved = _norm_bytes(rows, h, shape.norm, grad, norm_trains) + (T * h * shape.compute if head_trains else 0)
            # the final norm's input and rsqrt are not on the weight step's path; its normalised value and the
            # head's input are
            head = HeadActivations(saved, _norm_bytes(rows, h, shape.norm, grad, False))
        return PieceActivations(layers, head)


LLAMA_ACTIVATIONS = LlamaActivations()
