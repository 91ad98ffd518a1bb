"""Tensor parallelism (`model_parallel`) with torch.distributed.tensor.parallel: the generic appliers.

What to shard is the model family's decision: a model declares a plan, `{module-path glob: style name}` (see
`Transformer.tp_plan` in models/llama.py), with no torch.distributed in it. `apply_tp` turns each style name
into a torch ParallelStyle (the Megatron recipe) and applies it:

  colwise          weight split by output features; input replicated, output sharded on the last dim
  rowwise          weight split by input features; partial sums all-reduced (reduce-scattered along the
                   sequence under sequence parallelism)
  vocab_embedding  embedding split by vocabulary rows; output replicated (sequence-sharded under SP)
  vocab_head       output projection split by vocabulary; logits stay sharded for `loss_parallel`, so the
                   full [tokens, vocab] logits never exist on one rank
  norm             replicated-weight norm on the residual stream; local output
  norm_to_head     as norm, but hands a replicated DTensor on (a tied output projection is F.linear with the
                   embedding's DTensor weight, which then yields vocab-sharded logits)
  head_norm        per-head norm (q/k norm) over the heads this rank holds
  gather_sequence  a module that needs the whole sequence (attention, MLP): under sequence parallelism its first
                   input is all-gathered from sequence shards; nothing otherwise
  attention_heads  gather_sequence, and the module's own parameters (not its submodules'), each one value per
                   query head ([heads, ...], learned attention sinks), split by head as the colwise q_proj splits
                   the heads; the module computes with their local shards
  rowwise_full     rowwise with the whole output on every rank, even under sequence parallelism (shared experts)
  whole            weights whole on every rank, computed on local tensors (MoE router, routed experts)
  replicated_local a small linear whose weight is whole on every rank, local in and out (Qwen2-MoE's shared-expert
                   gate)
  moe_block        an MoE block under sequence parallelism: whole sequence in, its output cut back to the rank's
                   sequence shard; nothing otherwise
  sum_grad         identity forward; backward sums the input's gradient over tp (Megatron's copy to the tensor-
                   parallel region): a tensor every rank computes whole but only some heads of each rank use
                   (latent attention's rotary key, shared by every head)
  replicated, rowwise_to_replicated, replicated_to_output
                   the factors of a LoRA linear (models/lora.py `tp_subplan`)

A module that a model transform wrapped (a LoRA linear around q_proj, say) still gets its plan: when the module
at a planned path defines `tp_subplan(style) -> {relative path: style}`, the applier plans its pieces instead.
Every parameter must end up a DTensor (norms as Replicate), so AdamW's foreach kernels and the grad-norm
reduction see one kind of tensor; a parameter the plan misses is an error, not a silent replica.
"""

from __future__ import annotations

import fnmatch
from functools import partial

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module


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
            dt = DTensor.from_local(p, mesh, [Replicate()], run_check=False)
            module.register_parameter(p_name, nn.Parameter(dt, requires_grad=p.requires_grad))  # frozen stays frozen

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
        return distribute_module(
            module, mesh, self._params, partial(NormParallel._in, self), partial(NormParallel._out, self)
        )


class Replicated(ParallelStyle):
    """A small linear whose weight is whole on every tp rank (a LoRA factor): the input becomes a DTensor laid out
    as `in_placement`, the output is redistributed to `out_placement` and handed on as a local tensor only with
    `local_output` (kept a DTensor, the next layer's backward can reduce the partial gradients it produces)."""

    def __init__(self, in_placement, out_placement, local_output: bool):
        super().__init__()
        self.in_placement, self.out_placement, self.local_output = in_placement, out_placement, local_output

    _in = NormParallel._in  # the same input handling as a replicated-weight norm

    def _out(self, mod, out, mesh):
        out = out.redistribute(placements=[self.out_placement])
        return out.to_local() if self.local_output else out

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        return distribute_module(
            module, mesh, NormParallel._params, partial(Replicated._in, self), partial(Replicated._out, self)
        )


class VocabEmbedding(ParallelStyle):
    """An embedding split by vocabulary rows (Shard(0)): each rank looks up the ids in its rows, the partial sums
    are all-reduced (reduce-scattered along the sequence under sequence parallelism) and handed on as a local tensor.

    torch's RowwiseParallel does the same with an asynchronous collective, whose result (an AsyncCollectiveTensor)
    would be the first compiled layer's input: a compiled graph's backward does not route the gradient of such an
    input back through the collective (pytorch/pytorch#118671: async collective tensors at graph boundaries), so
    the embedding's reduction here is synchronous."""

    def __init__(self, out_placement):
        super().__init__()
        self.out_placement = out_placement

    @staticmethod
    def _params(name, module, mesh):
        for p_name, p in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(p_name, nn.Parameter(sharded, requires_grad=p.requires_grad))

    @staticmethod
    def _in(mod, inputs, mesh):
        return (DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False), *inputs[1:])

    def _out(self, mod, out, mesh):
        return out.redistribute(placements=[self.out_placement], async_op=False).to_local()

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        return distribute_module(module, mesh, self._params, self._in, partial(VocabEmbedding._out, self))


class GatherSequence(ParallelStyle):
    """All-gather the first input from sequence shards (Shard(1)) to the whole sequence, as a local tensor.

    Only the first positional input is an activation; the rest (rotary tables, cache, indices) pass untouched,
    so the module's signature does not matter (PrepareModuleInput needs a layout for every argument).
    """

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def gather(mod, args):
            x = DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False)
            return (x.redistribute(placements=[Replicate()]).to_local(), *args[1:])

        module.register_forward_pre_hook(gather)
        return module


class HeadParams(ParallelStyle):
    """`gather_sequence` (under sequence parallelism) and the module's own parameters sharded by query head
    (Shard(0)): rank r holds the heads its column-parallel q_proj computes. The module reads `to_local()`."""

    def __init__(self, seq_parallel: bool):
        super().__init__()
        self.seq_parallel = seq_parallel

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        return GatherSequence()._apply(module, mesh) if self.seq_parallel else module


class SumGradient(ParallelStyle):
    """Identity on the first input; its gradient is summed over tp in backward (the local gradient declared a
    partial sum, which DTensor all-reduces on the way back to the replicated input)."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def copy_in(mod, args):
            x = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
            return (x.to_local(grad_placements=[Partial()]), *args[1:])

        module.register_forward_pre_hook(copy_in)
        return module


class Whole(ParallelStyle):
    """A module whose weights stay whole on every tp rank (Replicate DTensors) and which computes on local tensors
    (reading its weights' `to_local()`): an MoE router and routed experts, run alike by every tp rank on the same
    tokens, so their gradients agree without a reduction."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        # Parameters only: buffers (the router's routing bias) stay plain tensors, updated alike on every rank.
        for name, sub in module.named_modules():
            NormParallel._params(name, sub, mesh)
        return module


class MoeBlockParallel(ParallelStyle):
    """An MoE block under sequence parallelism: the whole sequence in (all-gathered), and its output, whole on
    every tp rank (routed experts run alike on each, shared experts end in an all-reduce), cut back to this rank's
    sequence shard (backward all-gathers the shards' gradients)."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        GatherSequence()._apply(module, mesh)

        def scatter(mod, args, out):
            whole = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
            return whole.redistribute(placements=[Shard(1)]).to_local()

        module.register_forward_hook(scatter)
        return module


def make_style(name: str, seq_parallel: bool, float8: str = "") -> ParallelStyle | None:
    """The torch ParallelStyle of a plan's style name (None: nothing to do in this configuration). `float8`: the
    module is a tensorwise FP8 linear (parallel/float8.py's `float8_kind`), whose column and row styles are
    torchao's."""
    seq = Shard(1) if seq_parallel else Replicate()
    if float8 and name in FLOAT8_STYLES:
        return float8_style(name, seq, float8 == "tensorwise_bias")
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(output_layouts=seq),
        "vocab_embedding": lambda: VocabEmbedding(seq),
        "vocab_head": lambda: ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        "norm": lambda: NormParallel(seq),
        "norm_to_head": lambda: NormParallel(seq, Replicate()),
        "head_norm": lambda: NormParallel(Shard(2)),
        "gather_sequence": lambda: GatherSequence() if seq_parallel else None,
        "attention_heads": lambda: HeadParams(seq_parallel),
        "rowwise_full": lambda: RowwiseParallel(output_layouts=Replicate()),
        "whole": lambda: Whole(),
        "sum_grad": lambda: SumGradient(),
        "replicated_local": lambda: Replicated(Replicate(), Replicate(), local_output=True),
        "moe_block": lambda: MoeBlockParallel() if seq_parallel else None,
        # LoRA factors (models/lora.py): A of a column-parallel linear, then B of a row-parallel one's
        "replicated": lambda: Replicated(Replicate(), Replicate(), local_output=False),
        "rowwise_to_replicated": lambda: RowwiseParallel(output_layouts=Replicate(), use_local_output=False),
        "replicated_to_output": lambda: Replicated(Replicate(), seq, local_output=True),
    }
    if name not in styles:
        raise ValueError(f"unknown tensor-parallel style {name!r}: one of {', '.join(styles)}")
    return styles[name]()


FLOAT8_STYLES = ("colwise", "rowwise", "rowwise_full")


def float8_style(name: str, seq, bias: bool) -> ParallelStyle:
    """torchao's FP8 column / row styles (torchtitan's tensorwise TP): the input cast to FP8 before it is gathered
    or scattered, the gradient cast with one scale over the whole tensor. A linear with a bias keeps the plain
    styles' output (parallel/float8.py: float8_bias_styles)."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from meshformer.parallel.float8 import float8_bias_styles

    colwise, rowwise = float8_bias_styles() if bias else (Float8ColwiseParallel, Float8RowwiseParallel)
    if name == "colwise":
        return colwise()
    return rowwise(output_layouts=seq if name == "rowwise" else Replicate())


def resolve_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """Plan globs -> {exact module path: style} for the modules this (possibly pipeline-trimmed) model has,
    with wrapped modules expanded through their `tp_subplan`."""
    found: dict[str, str] = {}
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan.items():
        for name in names:
            if fnmatch.fnmatchcase(name, pattern):
                found.update(_expand(model.get_submodule(name), name, style))
    return found


def _expand(module: nn.Module, path: str, style: str) -> dict[str, str]:
    sub = getattr(module, "tp_subplan", None)
    if sub is None:
        return {path: style}
    out: dict[str, str] = {}
    for rel, sub_style in sub(style).items():
        out.update(_expand(module.get_submodule(rel), f"{path}.{rel}", sub_style))
    return out


def apply_tp(model: nn.Module, tp_mesh, plan: dict[str, str], seq_parallel: bool) -> None:
    """Shard a (meta-device, possibly pipeline-trimmed) model over `tp_mesh` in place, following `plan`."""
    from meshformer.parallel.float8 import float8_kind

    resolved = {
        path: make_style(style, seq_parallel, float8_kind(model.get_submodule(path)))
        for path, style in resolve_plan(model, plan).items()
    }
    resolved = {path: style for path, style in resolved.items() if style is not None}
    if resolved:
        parallelize_module(model, tp_mesh, resolved)
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise RuntimeError(
                f"tensor parallel plan does not cover parameter {name}: add its module to the "
                f"model's tp_plan (or a tp_subplan on the wrapper that holds it)"
            )
