"""Llama-architecture decoders with Mixture-of-Experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE).

Attention, norms, rotary and the dense MLP are the Llama family's (models/llama/model.py); a layer that
`ModelConfig.is_moe_layer` calls sparse gets an `MoEBlock` (models/moe/) as its `mlp`. Parameter names are ours:
`layers.N.mlp.gate.weight`, stacked `layers.N.mlp.experts.{gate,up,down}_proj`, `layers.N.mlp.shared_experts.*`;
hf.py maps Hugging Face's per-expert names (and Mixtral's `block_sparse_moe.experts.E.w1`) both ways.
"""

from __future__ import annotations

from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.models.llama.model import MLP, DecoderLayer, Transformer
from meshformer.models.llama.model import tp_plan as llama_tp_plan
from meshformer.models.moe import MoEBlock


class MoeDecoderLayer(DecoderLayer):
    def make_mlp(self, mc: ModelConfig, layer_idx: int) -> nn.Module:
        return MoEBlock(mc, layer_idx) if mc.is_moe_layer(layer_idx) else MLP(mc)


class MoeTransformer(Transformer):
    decoder_layer = MoeDecoderLayer


def param_count(mc: ModelConfig) -> int:
    """Parameters of the whole model, counted on one meta-device layer of each kind (no memory is allocated)."""
    from meshformer.models.sizes import layered_param_count

    return layered_param_count(MoeTransformer, mc)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Llama's plan for attention and dense MLPs; shared experts split like a dense MLP. Routed experts are
    parallel/expert_parallel.py's, not tensor parallelism's."""
    plan = llama_tp_plan(model)
    for name in ("gate_proj", "up_proj"):
        plan[f"layers.*.mlp.shared_experts.{name}"] = "colwise"
    plan.update(moe_tp_plan(model))
    return plan


def moe_tp_plan(model: nn.Module) -> dict[str, str]:
    """What tensor parallelism does to MoE blocks (any family): router and routed experts whole on every tp rank
    (expert parallelism splits the experts, parallel/expert_parallel.py), shared experts like a dense MLP but with
    the whole output, so the block's output is cut to the sequence shard once (parallel/tp.py `moe_block`)."""
    plan = {
        "layers.*.mlp.gate": "whole",
        "layers.*.mlp.experts": "whole",
        "layers.*.mlp.shared_expert_gate": "replicated_local",
        "layers.*.mlp.shared_experts.down_proj": "rowwise_full",
    }
    for name, layer in model.layers.items():
        if isinstance(layer.mlp, MoEBlock):  # exact paths win over the dense MLP's "layers.*.mlp" glob
            plan[f"layers.{name}.mlp"] = "moe_block"
    return plan
