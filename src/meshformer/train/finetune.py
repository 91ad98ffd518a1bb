"""`run_mode: finetune`: the model is the one `load_checkpoint` names, so a fine-tuning YAML needs no architecture.

The base model's `model_config` (a meshformer checkpoint's config.yaml, or a Hugging Face directory's
config.json) fills every shape field the run's config leaves out; a shape field the config does give must agree,
or one line says which differs. What belongs to the run stays the run's own: seq_length, dtypes, pet_config,
init and token-id settings. Only the weights come along (not the optimizer state or the step).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from meshformer.config.load import from_dict, load_yaml_text
from meshformer.config.model_schema import ModelConfig, RopeScalingConfig
from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import validate_config
from meshformer.errors import UserError

SHAPE_FIELDS = (
    "type",
    "hidden_size",
    "num_layers",
    "num_heads",
    "n_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "theta",
    "rope_scaling",
    "tie_word_embeddings",
    "qkv_has_bias",
    "use_qk_norm",
    "max_position_embedding",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "rope_interleave",
)
# moe_config fields that shape the network (which layers have experts, how many, how tokens are routed); the
# balancing losses, capacity and the bias update stay the run's, like the dtypes.
MOE_SHAPE_FIELDS = (
    "expert_num",
    "num_experts_chosen",
    "moe_intermediate_size",
    "shared_expert_num",
    "shared_expert_intermediate_size",
    "shared_expert_gate",
    "use_gating_sigmoid",
    "topk_method",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "decoder_sparse_step",
    "mlp_only_layers",
)


def base_model_config(src: str) -> ModelConfig:
    from meshformer.checkpoint.hf_config import model_config_from_hf
    from meshformer.checkpoint.hf_dir import _read_json, is_hf_dir
    from meshformer.checkpoint.store import resolve_checkpoint

    p = Path(src)
    if is_hf_dir(p):
        fields = model_config_from_hf(_read_json(p / "config.json"), f"{p}/config.json")
    else:
        ckpt = resolve_checkpoint(p)
        try:
            data = load_yaml_text((ckpt / "config.yaml").read_text(), f"{ckpt}/config.yaml")
            fields = data["model"]["model_config"]
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            raise UserError(f"load_checkpoint={src!r}: {ckpt}/config.yaml has no model.model_config") from None
    return from_dict(ModelConfig, fields, ("model", "model_config"), [])


def apply_finetune_base(cfg: MeshformerConfig) -> list[str]:
    """Fill the model shape from load_checkpoint (run_mode: finetune), then validate the whole config (load_config
    leaves a fine-tune's to this: its layout can only be checked against the real model); returns notices naming
    what was taken. Every command that uses a fine-tune's config calls it first."""
    if cfg.run_mode != "finetune":
        return []
    if not cfg.load_checkpoint:
        raise UserError("run_mode: finetune needs load_checkpoint (a checkpoint, run directory or Hugging Face model)")
    base = base_model_config(cfg.load_checkpoint)
    mc = cfg.model.model_config
    given = getattr(cfg, "given_model_fields", frozenset())
    taken = _take(mc, base, SHAPE_FIELDS, given, "")
    taken += _take(mc.moe_config, base.moe_config, MOE_SHAPE_FIELDS, given, "moe_config.")
    validate_config(cfg)
    return (
        [
            f"run_mode finetune: model shape from {cfg.load_checkpoint} ({mc.type}, {mc.num_layers} layers, hidden "
            f"{mc.hidden_size}, vocab {mc.vocab_size})"
        ]
        if taken
        else []
    )


def _take(ours_cfg, base_cfg, names, given, prefix: str) -> list[str]:
    """Copy each of `names` the run leaves out from the base; one line for a given one that differs."""
    taken = []
    for name in names:
        theirs = getattr(base_cfg, name)
        if prefix + name in given:
            ours = getattr(ours_cfg, name)
            same = vars(ours) == vars(theirs) if isinstance(ours, RopeScalingConfig) else ours == theirs
            if not same:
                raise UserError(
                    f"model.model_config.{prefix}{name}={_show(ours)} but the model in load_checkpoint has "
                    f"{_show(theirs)}: remove the field (run_mode: finetune takes the model's own) or fine-tune "
                    f"another model"
                )
        else:
            setattr(ours_cfg, name, theirs)
            taken.append(prefix + name)
    return taken


def _show(v) -> str:
    return str(vars(v)) if isinstance(v, RopeScalingConfig) else repr(v)
