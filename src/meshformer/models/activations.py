"""What the memory planner asks a model family about activations: the bytes each decoder layer saves for backward.

A family answers through its `ModelFamily.activation_model` (models/registry.py), an object with the
`ActivationModel` methods below; the Llama family's is closed-form arithmetic (models/llama/activations.py). A
family without one is counted on its real modules under FakeTensorMode (planner/counted_activations.py), and the
planner marks the figure as counted. The planner itself (planner/memory.py) owns what is not the layer's: model
states, micro-batches in flight, pipeline buffers, autocast's weight copies, the loss's log-softmax.

This module imports nothing of meshformer's, so a family's file may import its types without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ActivationShape:
    """What a layer's activations depend on besides the layer: one micro-batch and the layout's cuts."""

    micro_batch: int
    seq_length: int
    tp: int  # tensor-parallel degree
    sp: bool  # sequence parallel (only with tp > 1): the norms and the residual stream see a sequence shard
    norm: int  # element bytes of layernorm_compute_dtype
    compute: int  # element bytes of compute_dtype (autocast's, or the weights' without autocast)
    residual: int  # element bytes of the residual stream between layers (a received pipeline buffer's too)
    casts: bool  # autocast narrows a wider residual stream, once for every linear that keeps its input
    autocast: bool  # compute_dtype differs from param_init_type (the forward runs under autocast)
    ep: int = 1  # expert-parallel degree (selective recompute keeps its all-to-alls' outputs)
    expert_copies: bool = False  # autocast casts the routed experts' weights (no data parallelism gathers them low)
    select_policy: str = "matmuls"  # recompute_config.select_recompute_policy: which matmul outputs selective keeps

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length


@dataclass(frozen=True)
class LayerActivations:
    """One decoder layer's activation bytes for one micro-batch, on one rank."""

    saved: int  # saved for backward without recompute (a fully recomputed layer holds this again in its backward)
    grad_out: bool  # whether its output requires grad (decides what the next layer saves)
    full_recompute: int  # what a fully recomputed layer keeps through the forward: its input
    selective: int  # what a selectively recomputed layer keeps (parallel/recompute.py's policy)
    # what outlives the layer's weight-gradient action under a schedule that splits backward (zero bubble, ZBV,
    # DualPipeV); None: not modelled, the planner keeps the whole `saved` set to the step's end
    after_w: int | None = None


@dataclass(frozen=True)
class HeadActivations:
    """The last stage's final norm and output projection (the loss's log-softmax is the planner's)."""

    saved: int
    after_w: int | None = None  # as LayerActivations.after_w


@dataclass(frozen=True)
class PieceActivations:
    """A pipeline piece's layers (keyed as `piece.layers`) and, where it holds the final norm, its head."""

    layers: dict[str, LayerActivations]
    head: HeadActivations | None
    counted: bool = False  # True: counted on the modules (no formula for this family)


class ActivationModel(Protocol):
    """A family's activation model. `piece` is a meta-device pipeline piece of the family's model as the planner
    cuts it (model transforms applied: LoRA, freezing), `grad_in` whether its input requires grad (a later stage's
    does; the first stage's when the embedding trains), `sends_output` whether it hands its output to a later
    stage (the split-backward figures of its last layer differ), `styles` the resolved tensor-parallel plan of the
    piece ({module path: style}, parallel/tp.py; empty without tensor parallelism, and for a model whose
    `needs_styles` attribute is False, as closed-form arithmetic's is)."""

    def piece_activations(
        self,
        mc,
        piece,
        shape: ActivationShape,
        grad_in: bool,
        sends_output: bool,
        styles: dict[str, str],
    ) -> PieceActivations: ...


def kept_matmul(policy: str, index: int) -> bool:
    """Whether a selectively recomputed layer keeps the output of its `index`-th linear matmul (0-based, in the
    order its forward runs them) under recompute_config.select_recompute_policy: `matmuls` keeps every one,
    `alternate_matmuls` (torchtitan's op-level SAC) the first, third, ... (parallel/recompute.py applies it)."""
    return policy == "matmuls" or index % 2 == 0
