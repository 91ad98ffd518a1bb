"""DeepSeek-V2/V3 decoders: latent attention (mla.py) with Mixture-of-Experts blocks, on Llama's Transformer.

Norms, the residual stream, packed documents, pipeline trimming and the dense MLP of the first
`first_k_dense_replace` layers are Llama's (models/llama/model.py); each layer's attention is `LatentAttention`
(through the `make_attention` hook), its sparse MLP an `MoEBlock` (models/moe/) with the shared experts, and the
rotary tables cover only the decoupled rotary part (rope_yarn.py). Multi-token prediction layers are not built
(transformers does not load them either: its DeepSeek-V3 ignores `model.layers.61.*`, the MTP layer of the
published checkpoint); an import drops them the same way (hf.py).
"""

from __future__ import annotations

from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError
from meshformer.models.deepseek.mla import LatentAttention, LatentCache
from meshformer.models.deepseek.rope_yarn import MlaRopeTables
from meshformer.models.llama_moe.model import MoeDecoderLayer, MoeTransformer
from meshformer.models.llama_moe.model import tp_plan as moe_tp_plan


class DeepseekDecoderLayer(MoeDecoderLayer):
    def make_attention(self, mc: ModelConfig) -> nn.Module:
        return LatentAttention(mc)


class DeepseekTransformer(MoeTransformer):
    decoder_layer = DeepseekDecoderLayer
    rope_tables = MlaRopeTables

    def __init__(self, mc: ModelConfig):
        if getattr(mc, "kv_lora_rank", None) is None:
            raise UserError(
                f"model.model_config.type={mc.type} is latent attention: set kv_lora_rank (and qk_rope_head_dim, "
                f"qk_nope_head_dim, v_head_dim, optionally q_lora_rank), or import its config.json"
            )
        super().__init__(mc)

    def new_kv_cache(self, batch: int, max_len: int) -> LatentCache:
        p = next(self.parameters())
        mc = self.config
        return LatentCache(mc.num_layers, batch, max_len, mc.kv_lora_rank + mc.qk_rope_head_dim, p.dtype, p.device)


def param_count(mc: ModelConfig) -> int:
    """Parameters of the whole model, counted on one meta-device layer of each kind (no memory is allocated)."""
    from meshformer.models.sizes import layered_param_count

    return layered_param_count(DeepseekTransformer, mc)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Heads split as Megatron splits latent attention: q_proj / q_b_proj and kv_b_proj by output rows (whole
    heads), o_proj by input columns. The low-rank projections (q_a_proj, kv_a_proj_with_mqa) and their norms are
    whole on every rank, on local tensors: the gradients reaching them through q_b_proj and kv_b_proj are summed by
    those column-parallel linears, and the rotary key's, which each rank's heads give a part of, at `rope_key`.
    MoE blocks, shared experts and dense MLPs as the MoE Llama family's plan has them."""
    plan = moe_tp_plan(model)
    attn = {
        "q_b_proj": "colwise",
        "kv_b_proj": "colwise",
        "q_a_proj": "replicated_local",
        "q_a_layernorm": "replicated_local",
        "kv_a_proj_with_mqa": "replicated_local",
        "kv_a_layernorm": "replicated_local",
        "rope_key": "sum_grad",
    }
    plan.update({f"layers.*.self_attn.{name}": style for name, style in attn.items()})
    return plan
