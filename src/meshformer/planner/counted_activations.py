"""Activations of a family with no activation model, counted on its real modules (models/activations.py).

The planner's meta-device piece (pipeline cut, model transforms applied) is copied onto FakeTensors (shapes and
dtypes, no storage) and runs one forward of a micro-batch, under autocast where the run has it, inside
`saved_tensors_hooks`, as train/memory.py's ActivationCounter measures a real step: each distinct storage autograd
saves counts once, for the decoder layer running when it is first saved (after the last layer: the head), and the
model's parameters and buffers, views of them and autocast's copies of weights are not activations (the planner
adds the copies itself, as for every family). A second forward with every layer under parallel/recompute.py's
selective policy (the run's select_recompute_policy) counts what a selectively recomputed layer keeps (the kept
outputs reported to KEPT_LISTENERS plus the layer input the checkpoint saves); a fully recomputed layer keeps its
input. An `MoEBlock` (models/moe/) cannot run its routed experts on fake tensors (how many rows each expert gets
is data), so a stand-in runs its router and shared experts and adds the routed experts' bytes in closed form
(models/moe/activations.py); the rest of the layer, its attention whatever the family, is counted as above.

Tensor parallelism is not run: the layer is counted whole, and each saved tensor is cut by the style of the
innermost module of the tensor-parallel plan it was saved in (parallel/tp.py's styles, as Megatron's layout
places them): a norm's tensors and the residual stream's are sequence shards under SP, a column-parallel linear
keeps its whole input and makes a sharded output, a row-parallel one keeps a sharded input and makes a whole
(partial) output, and what lies in a `gather_sequence` module's region between them (attention, the MLP's
element-wise work) and a `head_norm` are sharded. Selective recompute under tensor parallelism also keeps the
outputs of the layer's collectives: one all-reduce per row-parallel module, or under SP one reduce-scatter per
row-parallel module and one all-gather of each `gather_sequence` (and `moe_block`) module's input. Not modelled:
what a split backward frees at its weight step (the whole set is kept to the step's end, an overestimate), a
module whose saved tensors do not follow those styles (a family that shards other work), and a frozen non-linear
weight's autocast copy of a shape no frozen 2-D parameter has. tests/unit/test_planner_family.py holds the counter to
the Llama formulas and to a toy family's measured step.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from meshformer.backends.torch_private import fake_tensor_mode, view_base
from meshformer.dtypes import DTYPE
from meshformer.models.activations import ActivationShape, HeadActivations, LayerActivations, PieceActivations

# (divisor of a saved tensor, of a kept op output) by the style of the innermost planned module it is made in;
# "sp" divides by the tensor-parallel degree under sequence parallelism only
_CUTS = {
    "norm": ("sp", "sp"),
    "norm_to_head": ("sp", "sp"),
    "head_norm": ("tp", "tp"),
    "colwise": (1, "tp"),
    "vocab_head": (1, "tp"),
    "rowwise": ("tp", 1),
    "rowwise_to_replicated": ("tp", 1),
    "gather_sequence": ("tp", "tp"),
    "vocab_embedding": (1, 1),
    # an MoE block computes on the whole sequence on every tp rank (its router and routed experts whole), its
    # shared experts end in a row-parallel linear with the whole output; "tp_region" is the planner's name for
    # what lies between their column- and row-parallel linears
    "moe_block": (1, 1),
    "whole": (1, 1),
    "replicated_local": (1, 1),
    "rowwise_full": ("tp", 1),
    "tp_region": ("tp", "tp"),
    None: ("sp", "sp"),  # outside every planned module: the residual stream
}
_HEAD = "head"


class CountedActivations:
    """models/activations.py's ActivationModel, by counting (module docstring). Counts are cached per piece and
    shape: a layout search asks for the same piece many times."""

    def __init__(self):
        self._cache: dict = {}

    def piece_activations(
        self, mc, piece, shape: ActivationShape, grad_in: bool, sends_output: bool, styles: dict[str, str]
    ) -> PieceActivations:
        key = (id(piece), shape, grad_in, tuple(sorted(styles.items())))
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            plain = _count(mc, piece, shape, grad_in, styles, selective=False)
            kept = _count(mc, piece, shape, grad_in, styles, selective=True)
            layers = {
                k: LayerActivations(
                    saved=plain.bytes.get(k, 0),
                    grad_out=plain.grad_out[k],
                    full_recompute=plain.inputs[k],
                    selective=kept.bytes.get(k, 0),
                )
                for k in piece.layers.keys()
            }
            head = HeadActivations(plain.bytes.get(_HEAD, 0)) if getattr(piece, "norm", None) is not None else None
            # the piece is held with its counts, so that its id is not reused while they are cached
            self._cache[key] = (piece, PieceActivations(layers, head, counted=True))
        return self._cache[key][1]


COUNTED = CountedActivations()


class _Count:
    """One fake forward's bytes by layer key (and _HEAD), each layer's input bytes and output's requires_grad."""

    def __init__(self, shape: ActivationShape, styles: dict[str, str], weights: list[torch.Tensor]):
        self.shape, self.styles = shape, dict(styles)
        self.bytes: dict[str, int] = {}
        self.inputs: dict[str, int] = {}
        self.grad_out: dict[str, bool] = {}
        self.layer: str | None = None  # the decoder layer running, _HEAD after the last
        self.modules: list[str] = []  # planned-module paths entered, innermost last
        self._model = {StorageWeakRef(w.untyped_storage()) for w in weights}  # parameters and buffers
        # a frozen weight's autocast copy has no autograd history to tell it by: its shape and dtype do (the
        # frozen linears' weights are cast beforehand, so this is left to others: a frozen tied embedding)
        self._frozen = {
            (tuple(w.shape), w.dtype)
            for w in weights
            if isinstance(w, nn.Parameter) and w.dim() == 2 and not w.requires_grad and shape.autocast
        }
        self._seen: set = set()
        self._alive: list[torch.Tensor] = []  # saved tensors stay alive, so no storage is freed and reused

    def _divisor(self, kept: bool) -> int:
        style = next((self.styles[m] for m in reversed(self.modules) if m in self.styles), None)
        cut = _CUTS.get(style, _CUTS[None])[kept]
        tp = self.shape.tp
        return tp if cut == "tp" or (cut == "sp" and self.shape.sp) else 1

    def add(self, key: str, nbytes: int) -> None:
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def _is_weight_copy(self, base: torch.Tensor) -> bool:
        fn = base.grad_fn
        if fn is not None:  # autocast's cast of a trainable weight: a copy whose only input is the parameter
            sources = [getattr(f, "variable", None) for f, _ in fn.next_functions if f is not None]
            return fn.name() == "ToCopyBackward0" and any(isinstance(v, nn.Parameter) for v in sources)
        return any(base.shape == s and base.dtype != dtype for s, dtype in self._frozen)

    def saved(self, t: torch.Tensor, kept: bool = False):
        base = view_base(t)
        if isinstance(base, nn.Parameter) or not (t.is_floating_point() or t.dtype == torch.bool):
            return t  # a parameter (or a view of one); token ids and labels are the batch's
        ref = StorageWeakRef(t.untyped_storage())
        if ref in self._model or ref in self._seen or self.layer is None or (not kept and self._is_weight_copy(base)):
            return t
        self._seen.add(ref)
        self._alive.append(t)
        self.add(self.layer, t.untyped_storage().nbytes() // self._divisor(kept))
        return t


def _count(mc, piece, shape: ActivationShape, grad_in: bool, styles: dict[str, str], selective: bool) -> _Count:
    from meshformer.models.init import canonical_name
    from meshformer.parallel.recompute import KEPT_LISTENERS, apply_recompute

    model = copy.deepcopy(piece)  # on the meta device: free; the planner's piece stays as it is
    if selective:
        apply_recompute(model, False, 0, True, select_policy=shape.select_policy)
    layer_keys = {id(m): k for k, m in model.layers.items()}
    residual = DTYPE[mc.compute_dtype] if shape.residual == shape.compute else DTYPE[mc.param_init_type]
    with fake_tensor_mode()(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        if shape.autocast:
            # data parallelism gathers compute-dtype weights (all of them); otherwise a frozen linear's weight is
            # cast here, as autocast would cast it, so that it saves the parameter and no copy to tell apart
            gathered = shape.residual == shape.compute
            for m in model.modules():
                for p in m.parameters(recurse=False):
                    if gathered or (isinstance(m, nn.Linear) and not p.requires_grad and p.dim() == 2):
                        p.data = p.data.to(DTYPE[mc.compute_dtype])
        count = _Count(shape, styles, [*model.parameters(), *model.buffers()])
        _stand_in_moe_blocks(mc, model, count, selective)
        _track(model, count, layer_keys, canonical_name, selective)
        size = (shape.micro_batch, shape.seq_length)
        if getattr(model, "embed_tokens", None) is not None:
            x = torch.randint(mc.vocab_size, size)
        else:  # a later pipeline stage receives the residual stream
            x = torch.empty(*size, mc.hidden_size, dtype=residual, requires_grad=grad_in)
        autocast = torch.autocast("cpu", dtype=DTYPE[mc.compute_dtype]) if shape.autocast else contextlib.nullcontext()
        listener = lambda t: count.saved(t, kept=True)  # noqa: E731
        KEPT_LISTENERS.append(listener)
        try:
            with autocast, torch.autograd.graph.saved_tensors_hooks(count.saved, lambda t: t):
                model(x)
        finally:
            KEPT_LISTENERS.remove(listener)
    return count


class _CountedMoE(nn.Module):
    """Stands in for an MoEBlock, whose routing a fake forward cannot run (how many rows each expert gets is the
    data's): its router, shared experts and shared-expert gate run on the fake input and are counted like any
    module (they are registered under the block's own names, so the tensor-parallel styles find them); the routed
    experts' bytes are added in closed form (models/moe/activations.py). The input passes on (a clone saves
    nothing)."""

    def __init__(self, block: nn.Module, mc, count: "_Count", selective: bool):
        super().__init__()
        self.gate = block.gate
        self.shared_experts = block.shared_experts
        self.shared_expert_gate = block.shared_expert_gate
        self.mc, self.count, self.selective = mc, count, selective
        self.experts_train = block.experts.gate_proj.requires_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from meshformer.backends.torch_private import grouped_mm_op
        from meshformer.models.moe.activations import routed_bytes
        from meshformer.parallel.recompute import SAVED_OPS

        sh = self.count.shape
        flat = x.reshape(-1, x.shape[-1])
        self.gate(flat)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                torch.sigmoid(self.shared_expert_gate(flat)) * shared
        experts = sh.compute if sh.autocast else x.element_size()
        saved, kept = routed_bytes(
            self.mc,
            flat.shape[0],
            x.element_size(),
            experts,
            self.experts_train,
            sh.expert_copies,
            sh.ep,
            grouped_mm_op() in SAVED_OPS,
        )
        if self.count.layer not in (None, _HEAD):
            self.count.add(self.count.layer, kept if self.selective else saved)
        return x.clone()


def _stand_in_moe_blocks(mc, model: nn.Module, count: "_Count", selective: bool) -> None:
    from meshformer.models.moe import MoEBlock

    for name, module in list(model.named_modules()):
        if isinstance(module, MoEBlock):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _CountedMoE(module, mc, count, selective))
            if count.styles and module.shared_experts is not None:
                # the shared experts' element-wise work lies between their column- and row-parallel linears
                count.styles[f"{name}.shared_experts"] = "tp_region"


def _first_tensor(value) -> torch.Tensor | None:
    """The first tensor of a hook's arguments or output (a tensor, or nested tuples and lists)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return None


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _track(model: nn.Module, count: _Count, layer_keys: dict[int, str], canonical_name, selective: bool) -> None:
    """Forward hooks that keep `count.layer` and `count.modules` current, note each layer's input and whether its
    output requires grad, and under selective recompute with tensor parallelism add its collectives' outputs."""
    shape = count.shape
    collectives = selective and shape.tp > 1

    def in_layer() -> bool:
        return count.layer not in (None, _HEAD)

    for name, module in model.named_modules():
        path = canonical_name(name)
        style = count.styles.get(path)

        def enter(mod, args, path=path, style=style):
            count.modules.append(path)
            if id(mod) in layer_keys:
                count.layer = layer_keys[id(mod)]
                count.inputs[count.layer] = _nbytes(_first_tensor(args)) // (shape.tp if shape.sp else 1)
            elif collectives and shape.sp and style in ("gather_sequence", "moe_block") and in_layer():
                count.add(count.layer, _nbytes(_first_tensor(args)))  # the all-gather's output: the whole sequence

        def leave(mod, args, out, style=style):
            count.modules.pop()
            if id(mod) in layer_keys:
                key = layer_keys[id(mod)]
                x, y = _first_tensor(args), _first_tensor(out)
                count.grad_out[key] = y is not None and y.requires_grad
                if not (count.grad_out[key] or (x is not None and x.requires_grad)):
                    count.inputs[key] = 0  # nothing will need the input again
                count.layer = _HEAD
            elif collectives and style in ("rowwise", "rowwise_to_replicated") and in_layer():
                # the all-reduce's output, or under SP the reduce-scatter's (a sequence shard)
                count.add(count.layer, _nbytes(_first_tensor(out)) // (shape.tp if shape.sp else 1))

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
