"""One process that computes as two tensor-parallel ranks do: the reference that holds tp2 under FP8 past step 1.

Tensor parallelism splits some sums over its ranks. In fp32 two half-length sums added round differently from one
full-length sum (a relative 1e-7), and a value near a float8 rounding boundary then lands in the other FP8 step at
the next cast (2^-4 relative in e4m3, 2^-2 in e5m2): against a plain one-process run, tp2 under FP8 holds only for
the first step. `tp_summation_order(parts, tp)` makes one process compute as the `tp` ranks do:

- every GEMM of a linear the model's tensor-parallel plan splits (its style names through parallel/tp.py's
  resolve_plan, not names here), FP8 or not (the vocabulary-split head), with the ranks' local shapes (a CPU BLAS
  picks its kernel, and so its order of accumulation, by the shapes): over a split contraction (a row-parallel
  forward, a column-parallel grad_input) the ranks' partial products added in rank order. The float8 operands are
  dequantized as torchao's CPU emulation does (data / scale, fp32);
- a column-parallel linear's bias gradient, each rank's column sum over the tokens; a per-head norm (q/k norm) run
  on each rank's heads, its weight gradient the ranks' sums added; a replicated norm run on its input as a node of
  its own, as the DTensor NormParallel makes it (which decides the order of the three terms of the input's
  gradient: the residual's and the norm's two);
- the cross-entropy over vocabulary-split logits as torch's `loss_parallel` computes it (torch/distributed/tensor/
  parallel/loss.py): each rank's sum of exponentials added in rank order, and its own backward ((one-hot of -1 +
  softmax) * grad, which rounds otherwise than log_softmax's backward);
- one thread, as each torchrun rank of the tests runs (conftest's torchrun_env).

The all-reduce adds the ranks' partial sums; for two ranks p0 + p1 == p1 + p0 exactly (IEEE addition commutes),
so gloo's reduction order cannot matter. For more ranks a ring all-reduce adds in a rotating order per chunk of
the buffer, which this reference does not model: it is built for tp2 (docs/benchmarks.md "FP8 layouts against one
process").
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from meshformer.dtypes import DTYPE
from meshformer.parallel.float8 import torchao_float8
from meshformer.parallel.tp import resolve_plan

# How a style shards each GEMM of its linear, as torch.mm(a [M, K], b [K, N]) on each rank: "k" the contraction
# (rank r multiplies its K chunk, the partial products are all-reduced), "n" the output's columns, "m" its rows
# (each rank computes its block). A column-parallel weight is split by output features (Shard(0)), a row-parallel
# one by input features (Shard(1)); tokens are never split (under sequence parallelism the input is gathered first).
# torchao's GEMMs: output = X @ W^T, grad_input = dY @ W, grad_weight = dY^T @ X.
STYLE_SPLITS = {
    "colwise": {"output": "n", "grad_input": "k", "grad_weight": "m"},
    "vocab_head": {"output": "n", "grad_input": "k", "grad_weight": "m"},
    "rowwise": {"output": "k", "grad_input": "n", "grad_weight": "n"},
    "rowwise_full": {"output": "k", "grad_input": "n", "grad_weight": "n"},
}


def _chunk(t: torch.Tensor, dim: int, r: int, tp: int) -> torch.Tensor:
    """Rank r's block of `t` along `dim` as that rank holds it: a dense tensor of its own (clone keeps the stride
    order, so a transposed weight shard stays transposed)."""
    size = t.shape[dim] // tp
    assert size * tp == t.shape[dim], f"dimension {t.shape[dim]} does not split over {tp} ranks"
    return t.narrow(dim, r * size, size).clone()


def rank_gemms(tp: int, a: torch.Tensor, b: torch.Tensor, split: str) -> torch.Tensor:
    """a @ b as `tp` ranks compute it, each GEMM with a rank's local shapes (a CPU BLAS picks its kernel, and so its
    order of accumulation, by the shapes): over "k" the partial products added in rank order, over "n" or "m" the
    ranks' blocks side by side."""
    if split == "k":
        out = None
        for r in range(tp):
            part = torch.mm(_chunk(a, 1, r, tp), _chunk(b, 0, r, tp))
            out = part if out is None else out + part
        return out
    if split == "n":
        return torch.cat([torch.mm(a, _chunk(b, 1, r, tp)) for r in range(tp)], 1)
    return torch.cat([torch.mm(_chunk(a, 0, r, tp), b) for r in range(tp)], 0)


def gemm_of(a, b) -> str:
    """Which of a linear's three GEMMs multiplies these float8 operands (torchao's roles)."""
    from torchao.float8.float8_training_tensor import GemmInputRole as R

    roles = {(R.INPUT, R.WEIGHT): "output", (R.GRAD_OUTPUT, R.WEIGHT): "grad_input"}
    return roles.get((a._gemm_input_role, b._gemm_input_role), "grad_weight")


def _split_config_class():
    from torchao.float8.float8_training_tensor import LinearMMConfig

    class SplitMMConfig(LinearMMConfig):
        """A linear's mm configs (equal to the plain ones, as torchao compares them) that also say how tensor
        parallelism splits each GEMM (`splits`, STYLE_SPLITS' values) over how many ranks (`tp`)."""

        splits: dict[str, str] = {}
        tp: int = 1

    return SplitMMConfig


class HeadByRanks(torch.autograd.Function):
    """F.linear without a bias (the mm it decomposes into, and autograd's mm backward), every GEMM as the ranks of
    a vocabulary-split head compute it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tp = tp
        x2 = x.reshape(-1, x.shape[-1])
        return rank_gemms(tp, x2, weight.t(), "n").view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = rank_gemms(ctx.tp, g2, weight, "k").view(x.shape)
        return grad_x, rank_gemms(ctx.tp, x2.t(), g2, "n").t(), None


class ShardedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of [tokens, vocab] logits as loss_parallel computes it over `tp` vocabulary shards."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, ignore: int, tp: int) -> torch.Tensor:
        x = x.contiguous()
        shifted = x - torch.amax(x, 1, keepdim=True)  # the max over shards is exact
        sumexp = None
        for r in range(tp):
            part = torch.sum(torch.exp(_chunk(shifted, 1, r, tp)), 1, keepdim=True)
            sumexp = part if sumexp is None else sumexp + part
        logp = shifted - torch.log(sumexp)
        keep = target != ignore
        picked = torch.gather(logp, 1, torch.where(keep, target, 0).unsqueeze(1)).squeeze(1)  # others add 0
        ctx.save_for_backward(logp, target)
        ctx.ignore = ignore
        return torch.where(keep, -picked, 0).sum()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        logp, target = ctx.saved_tensors
        keep = target != ctx.ignore
        onehot = torch.zeros_like(logp)
        onehot[torch.arange(logp.shape[0]), torch.where(keep, target, 0)] = -1.0
        return (onehot + torch.exp(logp)) * torch.where(keep.unsqueeze(1), g, 0), None, None, None


class BiasByRanks(torch.autograd.Function):
    """out + bias for a column-parallel linear: the bias gradient summed over the tokens by each rank on its own
    columns (the reduction's blocking depends on the width)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, bias: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.tp = tp
        return out + bias.to(out.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        lead = tuple(range(g.dim() - 1))
        return g, torch.cat([_chunk(g, g.dim() - 1, r, ctx.tp).sum(lead) for r in range(ctx.tp)]), None


def by_head_ranks(norm: nn.Module, tp: int):
    """A per-head norm's forward on [batch, seq, heads, head_dim] as the ranks run it, each on its own heads (its
    weight gradient: each rank's sum over its heads, the two added)."""
    forward = norm.forward

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([forward(_chunk(x, 2, r, tp)) for r in range(tp)], 2)

    return run


def on_own_input(norm: nn.Module):
    """A replicated norm's forward on a view of its input: a node of its own in the autograd graph, as the DTensor
    NormParallel makes of it (DTensor.from_local). The norm uses its input twice (the square and the scaling; the
    cast to its float32 compute dtype is no copy), so the input's gradient has three terms with the residual's:
    autograd adds them in one order where the input is shared, while under tp2 the norm's two are added first and
    the residual's to their sum."""
    forward = norm.forward
    return lambda x: forward(x.view_as(x))


def biased_colwise_forward(mod: nn.Module, tp: int):
    """torchao's Float8Linear.forward with the bias added through BiasByRanks."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    def run(x: torch.Tensor) -> torch.Tensor:
        out = matmul_with_hp_or_float8_args.apply(x, mod.weight.t(), mod.linear_mm_config, mod.config)
        return BiasByRanks.apply(out, mod.bias, tp)

    return run


def sharded_loss_fn(cfg, tp: int):
    """train/step.py's make_loss_fn with the cross-entropy of ShardedCrossEntropy."""
    mc = cfg.model.model_config
    dtype, ignore = DTYPE[mc.softmax_compute_dtype], mc.ignore_token_id

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ShardedCrossEntropy.apply(logits.flatten(0, 1).to(dtype), labels.flatten(), ignore, tp).float()

    return loss_fn


# The norms' styles (parallel/tp.py make_style) and how the reference runs each as the ranks do.
NORM_WRAPS = {
    "head_norm": by_head_ranks,
    "norm": lambda norm, tp: on_own_input(norm),
    "norm_to_head": lambda norm, tp: on_own_input(norm),
}


def split_linears(parts: list[nn.Module], tp: int) -> dict[str, str]:
    """Give each linear of the model's tensor-parallel plan its ranks' GEMMs: {module path: style}. A Float8Linear
    gets a SplitMMConfig (its emulated GEMMs then go through rank_gemms), a plain `vocab_head` linear HeadByRanks."""
    from torchao.float8.float8_linear import Float8Linear

    from meshformer.models.registry import family_of

    split_config = _split_config_class()
    marked = {}
    for part in parts:
        for path, style in resolve_plan(part, family_of(part.config).tp_plan(part)).items():
            mod = part.get_submodule(path)
            if style in NORM_WRAPS:
                mod.forward = NORM_WRAPS[style](mod, tp)
                marked[path] = style
            if style not in STYLE_SPLITS or not isinstance(mod, nn.Linear):
                continue
            if isinstance(mod, Float8Linear):
                mod.linear_mm_config = split_config(*mod.linear_mm_config)
                mod.linear_mm_config.splits, mod.linear_mm_config.tp = STYLE_SPLITS[style], tp
                if style == "colwise" and mod.bias is not None:
                    mod.forward = biased_colwise_forward(mod, tp)
            elif style == "vocab_head" and mod.bias is None:
                mod.forward = lambda x, mod=mod: HeadByRanks.apply(x, mod.weight, tp)
            else:
                raise AssertionError(f"{path}: a plain {style} linear, which this reference does not split")
            marked[path] = style
    return marked


@contextmanager
def tp_summation_order(model_parts, tp: int):
    """While open, `model_parts` (parallel/parts.py's ModelParts, one process) computes its split GEMMs and its
    cross-entropy as `tp`-way tensor parallelism does (the module doc). Yields {module path: style}."""
    torchao_float8()  # torchao's import, its start-up warnings silenced
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE as table

    entries = (torch.ops.aten.mm.default, torch.ops.aten.matmul.default)
    plain = {op: table[op] for op in entries}

    def mm(aten_op, args, kwargs=None):
        a, b = args[0], args[1]
        config = a._linear_mm_config
        split = getattr(config, "splits", {}).get(gemm_of(a, b))
        if split is None or not config.output.emulate:
            return plain[aten_op](aten_op, args, kwargs)
        out = rank_gemms(config.tp, a._data.float() / a._scale, b._data.float() / b._scale, split)
        return out.to(a._orig_dtype)

    marked = split_linears(model_parts.parts, tp)
    assert marked, "no linear that tensor parallelism splits"
    loss_fn, model_parts.loss_fn = model_parts.loss_fn, sharded_loss_fn(model_parts.cfg, tp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each rank runs one thread (conftest's torchrun_env): some CPU kernels split by threads
    for op in entries:
        table[op] = mm
    try:
        yield marked
    finally:
        table.update(plain)
        model_parts.loss_fn = loss_fn
        torch.set_num_threads(threads)
