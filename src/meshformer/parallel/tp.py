"""Tensor parallelism (`model_parallel`) with torch.distributed.tensor.parallel (Megatron-style plan).

Per decoder layer: q/k/v and gate/up are column-parallel (each rank computes a slice of the heads / of the
SwiGLU width), o and down are row-parallel (partial sums all-reduced, or reduce-scattered along the sequence
under sequence parallelism). The embedding is split by vocabulary rows; the output projection by vocabulary
columns and its logits stay sharded for `loss_parallel` (the full [tokens, vocab] logits never exist on one
rank). Every remaining parameter (the RMSNorm weights, q/k norms) becomes a Replicate DTensor so that all
parameters are DTensors: AdamW's foreach kernels and the grad-norm reduction then see one kind of tensor.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               RowwiseParallel, parallelize_module)


class NormParallel(ParallelStyle):
    """A norm whose weight is replicated over tp and whose input arrives as a local tensor.

    in_placement: how the local input is laid out across tp ranks: Replicate() (every rank has the whole
    activation), Shard(1) (sequence parallel) or Shard(2) (the q/k heads a rank holds: the per-head norm sees
    only local heads, so its weight gradient is a partial sum that DTensor reduces over tp).
    out_placement: None returns the local tensor; a placement returns a DTensor redistributed to it.
    """

    def __init__(self, in_placement, out_placement=None):
        super().__init__()
        self.in_placement, self.out_placement = in_placement, out_placement

    @staticmethod
    def _params(name, module, mesh):
        for p_name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(p_name, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False)))

    def _in(self, mod, inputs, mesh):
        x = inputs[0]
        if isinstance(x, DTensor):
            return x.redistribute(placements=[self.in_placement])
        return DTensor.from_local(x, mesh, [self.in_placement], run_check=False)

    def _out(self, mod, out, mesh):
        if self.out_placement is None:
            return out.to_local()
        return out.redistribute(placements=[self.out_placement])

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        return distribute_module(module, mesh, self._params, partial(NormParallel._in, self),
                                 partial(NormParallel._out, self))


def apply_tp(model: nn.Module, tp_mesh, seq_parallel: bool, tied: bool) -> None:
    """Shard a (meta-device, possibly pipeline-trimmed) Transformer over `tp_mesh` in place."""
    seq = Shard(1) if seq_parallel else Replicate()
    top = {}
    if model.embed_tokens is not None:
        top["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        # Tied weights: the output projection is F.linear(h, embed_tokens.weight) in the model's forward, so the
        # norm hands over a replicated DTensor and DTensor's linear gives vocab-sharded logits.
        top["norm"] = NormParallel(seq, Replicate() if tied else None)
    if model.lm_head is not None:
        top["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    for layer in model.layers.values():
        plan = {
            "input_layernorm": NormParallel(seq),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            "post_attention_layernorm": NormParallel(seq),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        }
        if seq_parallel:
            # Attention and MLP need the whole sequence: all-gather it on the way in (rope slices by length).
            # self_attn is called as (x, rope, start, cache, layer_idx): only x is a tensor to lay out.
            plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                                   desired_input_layouts=(Replicate(), None, None, None, None),
                                                   use_local_output=True)
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                             use_local_output=True)
        if layer.self_attn.q_norm is not None:
            plan["self_attn.q_norm"] = NormParallel(Shard(2))
            plan["self_attn.k_norm"] = NormParallel(Shard(2))
        parallelize_module(layer, tp_mesh, plan)
    # Anything left plain (nothing in the Llama family today) would mix Tensor and DTensor in AdamW.
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise RuntimeError(f"tensor parallel plan does not cover parameter {name}")
