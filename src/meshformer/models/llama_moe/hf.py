"""The MoE Llama family's Hugging Face config.json and tensor names, both ways (Mixtral, Qwen2-MoE, Qwen3-MoE).

config.json: the Llama keys (models/llama/hf.py `common_fields` / `common_hf`) plus each architecture's MoE keys.
Mixtral always renormalises its top-k weights and has no dense layers; Qwen2-MoE adds a shared expert scaled by a
sigmoid gate and q/k/v biases (`qkv_bias`, default true); Qwen3-MoE adds q/k norms. A layer is sparse where
Hugging Face's rule says (`idx not in mlp_only_layers and (idx + 1) % decoder_sparse_step == 0`), which is ours.

Balancing: Hugging Face adds its `router_aux_loss_coef` loss only when `output_router_logits` is true, computed
over one forward's tokens (a micro-batch), so it is read as `aux_loss_types: [micro_batch]` then and otherwise not
at all; meshformer's layout-independent losses (global_batch, sequence) are chosen in moe_config by the run.

Tensors: on disk Hugging Face names every expert's matrices apart (`model.layers.N.mlp.experts.E.gate_proj.weight`,
Mixtral's `model.layers.N.block_sparse_moe.experts.E.w1.weight` and `block_sparse_moe.gate.weight`, Qwen2-MoE's
`mlp.shared_expert.*`), which is what `save_pretrained` writes although transformers 5 fuses experts in memory;
ours are stacked (`layers.N.mlp.experts.gate_proj` [E, F, D]) and the shared expert is `mlp.shared_experts`.
What a Hugging Face architecture cannot express (sigmoid routing, group-limited top-k, a routing bias, a scaling
factor) is refused in one line on export instead of being dropped.
"""

from __future__ import annotations

import torch

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.llama.hf import common_fields, common_hf, refuse_first
from meshformer.models.moe.hf_experts import split_experts, stack_experts
from meshformer.models.registry import hf_model_type, hf_prefixed, hf_unprefixed

# Hugging Face model_type -> (our model_config.type, architecture class)
CONFIG_TYPES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
HF_MODEL_TYPES = {mt: arch for mt, (_, arch) in CONFIG_TYPES.items()}
_BY_TYPE = {ours: mt for mt, (ours, _) in CONFIG_TYPES.items()}

# Hugging Face's per-expert leaf -> our stacked parameter
MIXTRAL_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
QWEN_LEAVES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def _int(hf: dict, where: str, *keys: str) -> int:
    """The first of `keys` the file gives, as an integer (Qwen3-MoE files spell the expert count either way)."""
    for key in keys:
        if isinstance(hf.get(key), int) and not isinstance(hf.get(key), bool):
            return hf[key]
    raise UserError(f"{where}: {keys[0]} missing or not an integer")


def _window_off(hf: dict) -> bool:
    """Mixtral's sliding window (Mistral's) is plain causal attention: null, or at least the context the model is
    made for (max_position_embeddings)."""
    window, context = hf.get("sliding_window"), hf.get("max_position_embeddings")
    return window is None or (isinstance(window, int) and isinstance(context, int) and window >= context)


def _refuse(hf: dict, model_type: str, where: str) -> None:
    act = hf.get("hidden_act", "silu")
    mixtral_window_off = _window_off(hf)
    problems = {
        "hidden_act": (act != "silu", f"{act!r} (the experts are SwiGLU with silu)"),
        "attention_bias": (bool(hf.get("attention_bias")), "true (a bias on o_proj as well as q/k/v)"),
        "mlp_bias": (bool(hf.get("mlp_bias")), "true"),
        "use_sliding_window": (bool(hf.get("use_sliding_window")), "true (sliding-window attention): set it false"),
        "sliding_window": (
            model_type == "mixtral" and not mixtral_window_off,
            f"{hf.get('sliding_window')!r} (sliding-window attention): only null or at least "
            f"max_position_embeddings is the causal attention meshformer builds",
        ),
        "router_jitter_noise": (
            bool(hf.get("router_jitter_noise")),
            f"{hf.get('router_jitter_noise')} (training-time noise on router inputs): set it to 0.0",
        ),
    }
    refuse_first(problems, where, sep="=")


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields (moe_config included) of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    model_type = hf_model_type(hf, HF_MODEL_TYPES, where, "Mixtral, Qwen2-MoE or Qwen3-MoE")
    _refuse(hf, model_type, where)
    experts = _int(
        hf, where, *(("num_local_experts",) if model_type == "mixtral" else ("num_experts", "num_local_experts"))
    )
    top_k = _int(hf, where, "num_experts_per_tok")
    renorm = True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False))
    if experts < 2:
        raise UserError(f"{where}: {experts} expert(s) is a dense model: import it as its dense family")
    if not 1 <= top_k <= experts:
        raise UserError(f"{where}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts")
    if top_k == 1 and renorm:
        raise UserError(
            f"{where}: num_experts_per_tok=1 with renormalised weights (every weight 1.0) is not supported: "
            f"meshformer's router keeps the top-1 probability as the weight so the router trains"
        )
    fields = {"type": CONFIG_TYPES[model_type][0], **common_fields(hf, where)}
    moe = {"expert_num": experts, "num_experts_chosen": top_k, "norm_topk_prob": renorm}
    if model_type == "mixtral":
        moe["moe_intermediate_size"] = fields["intermediate_size"]
    else:
        moe["moe_intermediate_size"] = _int(hf, where, "moe_intermediate_size")
        moe["decoder_sparse_step"] = _int(hf, where, "decoder_sparse_step") if "decoder_sparse_step" in hf else 1
        moe["mlp_only_layers"] = list(hf.get("mlp_only_layers") or [])
    if model_type == "qwen2_moe":
        moe["shared_expert_num"] = 1
        moe["shared_expert_intermediate_size"] = _int(hf, where, "shared_expert_intermediate_size")
        moe["shared_expert_gate"] = True
    coef = hf.get("router_aux_loss_coef", 0.001)  # transformers' default where the file has none
    if hf.get("output_router_logits") and coef:
        moe["aux_loss_types"] = ["micro_batch"]
        moe["aux_loss_factors"] = [float(coef)]
    fields["qkv_has_bias"] = model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True))
    fields["use_qk_norm"] = model_type == "qwen3_moe"
    fields["moe_config"] = moe
    return fields


def _refuse_export(mc: ModelConfig, model_type: str) -> None:
    m = mc.moe_config
    arch = CONFIG_TYPES[model_type][1]
    M = "model.model_config.moe_config"
    sparse = [i for i in range(mc.num_layers) if mc.is_moe_layer(i)]
    problems = [
        (m.use_gating_sigmoid, f"{M}.use_gating_sigmoid=true (it routes by softmax)"),
        (m.topk_method != "greedy", f"{M}.topk_method={m.topk_method} (it routes greedily over all experts)"),
        (m.routed_scaling_factor != 1.0, f"{M}.routed_scaling_factor={m.routed_scaling_factor} (it has none)"),
        (m.balance_via_topk_bias, f"{M}.balance_via_topk_bias=true (it has no routing bias)"),
        (m.router_bias, f"{M}.router_bias=true (its router has no bias)"),
        (m.expert_bias, f"{M}.expert_bias=true (its experts have no biases)"),
        (m.expert_activation != "silu", f"{M}.expert_activation={m.expert_activation} (its experts are SwiGLU)"),
        (model_type == "mixtral" and not m.norm_topk_prob, f"{M}.norm_topk_prob=false (Mixtral renormalises)"),
        (model_type == "mixtral" and len(sparse) != mc.num_layers, "dense layers (every Mixtral layer is sparse)"),
        (
            model_type == "mixtral" and mc.expert_ffn_size != mc.ffn_hidden_size,
            f"{M}.moe_intermediate_size other than intermediate_size (Mixtral's experts are intermediate_size wide)",
        ),
        (model_type != "qwen2_moe" and mc.shared_ffn_size > 0, "shared experts (only Qwen2-MoE has one)"),
        (
            model_type == "qwen2_moe" and not (mc.shared_ffn_size and m.shared_expert_gate),
            f"no gated shared expert (Qwen2-MoE has one: set {M}.shared_expert_intermediate_size, shared_expert_gate)",
        ),
        (mc.qkv_has_bias and model_type != "qwen2_moe", "qkv_has_bias=true (only Qwen2-MoE has q/k/v biases)"),
        (mc.use_qk_norm != (model_type == "qwen3_moe"), f"use_qk_norm={mc.use_qk_norm} (Qwen3-MoE only, and always)"),
    ]
    for bad, what in problems:
        if bad:
            raise UserError(f"model_config: type {mc.type} with {what} has no {arch} spelling in Hugging Face")


def config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    """A config.json that `transformers` reads back as the same model."""
    model_type = _BY_TYPE[mc.type]
    _refuse_export(mc, model_type)
    m = mc.moe_config
    hf = common_hf(mc, model_type, CONFIG_TYPES[model_type][1], dtype)
    micro = [f for t, f in zip(m.aux_loss_types, m.aux_loss_factors) if t == "micro_batch"]
    hf.update(num_experts_per_tok=m.num_experts_chosen, output_router_logits=bool(micro))
    hf["router_aux_loss_coef"] = float(micro[0]) if micro else 0.001  # transformers' default when it is unused
    if model_type == "mixtral":
        hf.update(num_local_experts=m.expert_num, intermediate_size=mc.expert_ffn_size, sliding_window=None)
        hf["router_jitter_noise"] = 0.0
        return hf
    # first_k_dense_replace is Qwen's mlp_only_layers for the first k layers: the same layers stay dense
    dense = sorted(set(m.mlp_only_layers) | set(range(min(m.first_k_dense_replace, mc.num_layers))))
    hf.update(
        num_experts=m.expert_num,
        moe_intermediate_size=mc.expert_ffn_size,
        decoder_sparse_step=m.decoder_sparse_step,
        mlp_only_layers=dense,
        norm_topk_prob=m.norm_topk_prob,
        use_sliding_window=False,
        sliding_window=None,
    )
    if model_type == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=mc.shared_ffn_size, qkv_bias=mc.qkv_has_bias)
    else:
        hf["attention_bias"] = False
    return hf


def from_hf(name: str) -> str | None:
    """A Hugging Face tensor name -> ours (experts still per expert: `from_hf_tensors` stacks them)."""
    ours = hf_unprefixed(name)
    if ours is None:
        return None
    return ours.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.shared_expert.", ".mlp.shared_experts.")


def from_hf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked (either spelling); transformers 5's in-memory fused `experts.gate_up_proj`
    [E, 2F, D] (a state_dict saved as is) split into our gate_proj and up_proj."""
    out = {}
    for name, t in stack_experts(tensors, {**MIXTRAL_LEAVES, **QWEN_LEAVES}).items():
        if name.endswith(".experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj"], out[stem + "up_proj"] = (c.contiguous() for c in t.chunk(2, dim=1))
        else:
            out[name] = t
    return out


def to_hf_for(mc: ModelConfig):
    """The export renaming of this config's architecture: our state dict -> Hugging Face's names on disk."""
    mixtral = _BY_TYPE[mc.type] == "mixtral"

    def rename(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        split = split_experts(state, MIXTRAL_LEAVES if mixtral else QWEN_LEAVES)
        out = {}
        for name, t in split.items():
            if mixtral:
                name = name.replace(".mlp.", ".block_sparse_moe.")
            else:
                name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            out[hf_prefixed(name)] = t
        return out

    return rename
