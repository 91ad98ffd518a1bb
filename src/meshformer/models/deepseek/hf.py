"""DeepSeek-V2/V3's Hugging Face config.json and tensor names, both ways.

What transformers 5 computes is what an import means, where it departs from the config keys: DeepSeek-V2 routes by
softmax, greedy or group-limited (its group scored by its best expert), and never renormalises the top-k weights
(its config's norm_topk_prob is not read); DeepSeek-V3 always routes by sigmoid with the score-correction bias and
group-limited top-k by the sum of each group's top two (`noaux_tc`, whatever topk_method says), renormalised when
norm_topk_prob. Both rotate the rotary part on interleaved pairs (V2 always, V3 unless rope_interleave is false).
What the model here cannot compute the same way (biases, other activations, other rope scalings) is refused in one
line naming the key.

Tensors: Hugging Face's names are ours with `model.` in front, but for the routed experts, which are per expert on
disk (`model.layers.N.mlp.experts.E.gate_proj.weight`) and stacked here (`layers.N.mlp.experts.gate_proj`). The
router is `mlp.gate.weight` with V3's `mlp.gate.e_score_correction_bias`, the shared experts `mlp.shared_experts.*`.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.deepseek.config import YarnRopeScalingConfig
from meshformer.models.llama.hf import common_fields, common_hf, refuse_first
from meshformer.models.moe.hf_experts import split_experts, stack_experts
from meshformer.models.registry import hf_model_type

# Hugging Face model_type -> (our model_config.type, architecture class)
CONFIG_TYPES = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
HF_MODEL_TYPES = {mt: arch for mt, (_, arch) in CONFIG_TYPES.items()}
EXPERT_LEAVES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _rope(hf: dict, where: str) -> tuple[float, dict]:
    """(theta, our rope_scaling section) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    spec = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = spec.get("rope_type", spec.get("type", "default")) if spec else "default"
    if kind in ("default", None):
        return theta, {"type": "none"}
    if kind != "yarn":
        raise UserError(f"{where}: rope scaling {kind!r} is not supported for DeepSeek (default and yarn are)")
    if spec.get("attention_factor") is not None or spec.get("truncate", True) is not True:
        raise UserError(f"{where}: yarn rope scaling with attention_factor or truncate: false is not supported")
    if not isinstance(spec.get("original_max_position_embeddings"), int):
        raise UserError(f"{where}: yarn rope scaling lacks original_max_position_embeddings")
    factor = spec.get("factor") or hf["max_position_embeddings"] / spec["original_max_position_embeddings"]
    return theta, {
        "type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": spec["original_max_position_embeddings"],
        "beta_fast": float(spec.get("beta_fast") or 32),
        "beta_slow": float(spec.get("beta_slow") or 1),
        "mscale": float(spec.get("mscale") or 0.0),  # 0: not given (rope_yarn.py)
        "mscale_all_dim": float(spec.get("mscale_all_dim") or 0.0),
    }


def _refuse_unsupported(hf: dict, model_type: str, where: str) -> None:
    act = hf.get("hidden_act", "silu")
    scoring = hf.get("scoring_func")
    wanted_scoring = "sigmoid" if model_type == "deepseek_v3" else "softmax"
    problems = {
        "hidden_act": (act != "silu", f"{act!r} (the experts are SwiGLU with silu)"),
        "attention_bias": (bool(hf.get("attention_bias")), "true"),
        "mlp_bias": (bool(hf.get("mlp_bias")), "true"),
        "scoring_func": (
            scoring is not None and scoring != wanted_scoring,
            f"{scoring!r} (transformers' {model_type} routes by {wanted_scoring})",
        ),
        "topk_method": (
            model_type == "deepseek_v2" and hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"),
            f"{hf.get('topk_method')!r} (DeepSeek-V2 routes greedy or group_limited_greedy)",
        ),
        "kv_lora_rank": (not isinstance(hf.get("kv_lora_rank"), int), "missing (latent attention needs it)"),
    }
    refuse_first(problems, where, "DeepSeek model")


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields (a dict for the config loader) of a DeepSeek-V2/V3 config.json."""
    model_type = hf_model_type(hf, HF_MODEL_TYPES, where, "DeepSeek-V2 or DeepSeek-V3")
    _refuse_unsupported(hf, model_type, where)
    required = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "vocab_size",
        "n_routed_experts",
        "num_experts_per_tok",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    )
    missing = [k for k in required if not isinstance(hf.get(k), int)]
    if missing:
        raise UserError(f"{where}: {', '.join(missing)} missing or not an integer")
    v3 = model_type == "deepseek_v3"
    theta, scaling = _rope(hf, where)
    moe = {
        "expert_num": hf["n_routed_experts"],
        "num_experts_chosen": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "shared_expert_num": hf.get("n_shared_experts") or 0,
        "use_gating_sigmoid": v3,
        "topk_method": "noaux_tc" if v3 else hf.get("topk_method", "greedy"),
        "n_group": hf.get("n_group") or 1,
        "topk_group": hf.get("topk_group") or 1,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)) if v3 else False,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "first_k_dense_replace": hf.get("first_k_dense_replace") or 0,
    }
    # Shapes, norm, context and token ids as every Llama-architecture config.json gives them; the rotary settings
    # are read above (YaRN), and key/value heads and head_dim mean nothing under latent attention.
    fields = common_fields({**hf, "rope_scaling": None, "rope_parameters": None, "rope_theta": theta}, where)
    for key in ("n_kv_heads", "head_dim"):
        fields.pop(key)
    fields.update(
        type=CONFIG_TYPES[model_type][0],
        rope_scaling=scaling,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
        moe_config=moe,
    )
    return fields


def _refuse_unexportable(mc: ModelConfig, model_type: str) -> None:
    m = mc.moe_config
    v3 = model_type == "deepseek_v3"
    problems = {
        "use_gating_sigmoid": m.use_gating_sigmoid != v3,
        "topk_method": (m.topk_method == "noaux_tc") != v3,
        "norm_topk_prob": m.norm_topk_prob and not v3,
        "balance_via_topk_bias": m.balance_via_topk_bias and not v3,
        "shared_expert_intermediate_size": m.shared_expert_intermediate_size is not None,
        "shared_expert_gate": m.shared_expert_gate,
        "decoder_sparse_step": m.decoder_sparse_step != 1,
        "mlp_only_layers": bool(m.mlp_only_layers),
        "rope_interleave": not mc.rope_interleave and not v3,
        "router_bias": m.router_bias,
        "expert_bias": m.expert_bias,
        "expert_activation": m.expert_activation != "silu",
    }
    for key, bad in problems.items():
        if bad:
            raise UserError(
                f"model_config.moe_config.{key} (or model_config.{key}) as set has no {CONFIG_TYPES[model_type][1]} "
                f"spelling: transformers would compute another model"
            )


def config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    """A config.json that transformers reads back as the same model (rope in the rope_scaling spelling, which
    transformers 4 and 5 both read)."""
    model_type = {family: mt for mt, (family, _) in CONFIG_TYPES.items()}[mc.type]
    _refuse_unexportable(mc, model_type)
    m, rs = mc.moe_config, mc.rope_scaling
    scaling = None
    if rs.type == "yarn":
        scaling = {"rope_type": "yarn", **{k: getattr(rs, k) for k in YARN_KEYS}}
        scaling = {k: v for k, v in scaling.items() if not (k in ("mscale", "mscale_all_dim") and not v)}
    elif rs.type != "none":
        raise UserError(f"model_config.rope_scaling.type={rs.type} has no DeepSeek spelling: use none or yarn")
    # The keys every Llama-architecture model writes the same way; the rotary part's, the heads' and the experts'
    # are DeepSeek's own
    hf = common_hf(replace(mc, rope_scaling=YarnRopeScalingConfig()), model_type, CONFIG_TYPES[model_type][1], dtype)
    hf.pop("head_dim")
    hf.update(
        {
            "rope_scaling": scaling,
            "num_key_value_heads": mc.num_heads,
            "moe_intermediate_size": mc.expert_ffn_size,
            "q_lora_rank": mc.q_lora_rank,
            "kv_lora_rank": mc.kv_lora_rank,
            "qk_rope_head_dim": mc.qk_rope_head_dim,
            "qk_nope_head_dim": mc.qk_nope_head_dim,
            "v_head_dim": mc.v_head_dim,
            "n_routed_experts": m.expert_num,
            "num_experts_per_tok": m.num_experts_chosen,
            "n_shared_experts": m.shared_expert_num,
            "n_group": m.n_group,
            "topk_group": m.topk_group,
            "norm_topk_prob": m.norm_topk_prob,
            "routed_scaling_factor": m.routed_scaling_factor,
            "first_k_dense_replace": m.first_k_dense_replace,
            "topk_method": m.topk_method,
            "scoring_func": "sigmoid" if model_type == "deepseek_v3" else "softmax",
            "attention_bias": False,
        }
    )
    if model_type == "deepseek_v3":
        hf["rope_interleave"] = mc.rope_interleave
        hf["num_nextn_predict_layers"] = 0  # no multi-token prediction layers are written
    else:
        hf["mlp_bias"] = False
    return hf


def from_hf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert routed experts stacked (the other names are renamed already); multi-token prediction layers
    dropped, as transformers drops them: a layer with an `eh_proj` (the MTP module's projection of the embedding
    and hidden state, in DeepSeek-V3's published checkpoint layer 61) is no decoder layer of the model."""
    mtp = {name.split(".")[1] for name in tensors if re.fullmatch(r"layers\.\d+\.eh_proj\.weight", name)}
    kept = {k: t for k, t in tensors.items() if not (k.startswith("layers.") and k.split(".")[1] in mtp)}
    return stack_experts(kept, EXPERT_LEAVES)


def to_hf_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked routed experts split per expert, before the `model.` prefix is added."""
    return split_experts(state, EXPERT_LEAVES)
