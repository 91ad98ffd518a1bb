"""The MoE Llama family's Hugging Face config.json and tensor names, both ways (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

from meshformer.errors import UserError

# Hugging Face model_type -> (our model_config.type, architecture class)
CONFIG_TYPES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
HF_MODEL_TYPES = {mt: arch for mt, (_, arch) in CONFIG_TYPES.items()}


def config_from_hf(hf: dict, where: str = "config.json") -> dict:
    raise UserError(f"{where}: importing MoE models is being built")


def config_to_hf(mc, dtype: str) -> dict:
    raise UserError("exporting MoE models is being built")
