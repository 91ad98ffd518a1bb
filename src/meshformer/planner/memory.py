"""Memory of every pipeline stage's rank, predicted from the config alone (nothing allocated).

Model states are counted parameter by parameter on the meta-device model, cut exactly as `parallelize` cuts it:
the pipeline split (`split_pipeline`), the family's tensor-parallel plan (`resolve_plan`: which dimension each
style shards, uneven splits rounded up) and FSDP's dim-0 shards (padded to equal size). Gradients exist for
trainable parameters only; AdamW keeps two moments in the parameter's dtype and a 4-byte step per parameter.
A QLoRA base weight counts its NF4 storage as torchao holds it (models/qlora.py `nf4_local_bytes`): half a byte
per weight, an int8 scale per 64 weights, a factor per scaler block, the scale mean and the 16-entry code table.

Activations (the bytes autograd saves for backward) are the model family's to say, per decoder layer and
micro-batch: models/activations.py's `ActivationModel`, which a family registers as its `activation_model`
(models/registry.py) beside its modules. A family without one is counted on its real modules under FakeTensorMode
(planner/counted_activations.py: one fake forward, the distinct storages saved) and the plan marks the figure
`activations_counted`. What is not the layer's stays here, for every family: micro-batches in flight, pipeline
buffers, autocast's weight copies, the log-softmax, recompute's working set.

The Llama family's model (models/llama/activations.py) follows the operations of models/llama/model.py, per layer
and micro-batch of T = micro_batch x seq_length tokens, in Korthikanti et al.'s style (sbh(34 + 5as/h) for
GPT-3's layer) but for this layer: RMSNorm, SwiGLU, GQA and SDPA, which keeps no s x s scores. With element sizes
n (norm dtype), a (compute dtype), tensor parallel degree t, sequence parallel dividing the norms' part:

    per RMSNorm   2 T h n + T n        (its fp32 input and normalised value, the rsqrt)    [/ t with SP]
                  + T h a              (the next linear's input: one storage for q, k, v or gate, up; under
                                        autocast from a wider residual stream, one copy per linear)
    attention     (2 T q + 2 T kv) a / t + 4 T heads / t    (q, k after rotary, v, the output; the log-sum-exp)
    q/k norm      (2 T q + 2 T kv + T heads + T kv_heads) n / t
    SwiGLU        4 T f a / t          (gate, silu(gate), up, their product)

(q = heads x head_dim, kv = kv_heads x head_dim, f = ffn width.) Full recompute keeps each layer's input (T h, / t
with SP) and recomputes one layer at a time in backward: that layer's set is `recompute_bytes`, apart from the saved
activations (it is not saved for backward but made again in it; the loss's tensors are gone by then, so the peak is
at most their sum). Autocast without data parallelism keeps a compute-dtype copy of every matmul weight; a
recomputed layer's (full or selective) are not saved for backward but live in autocast's cache to the forward's end
(`autocast_cache_bytes`, beside the logits) and are made again in its backward, with its set. The last stage adds
the final norm and the log-softmax of the logits in softmax_compute_dtype (T x vocab / t under tensor parallel: loss
parallel; a distillation loss's saved tensors instead, planner/distill_memory.py). Token ids, labels and the rotary
tables are the batch's and the model's memory, not activations. A stage
holds as many micro-batches in flight as its schedule makes it (all of them under GPipe, pp - rank under 1F1B;
multi-stage schedules are replayed from their own action list, planner/schedule.py), and a later stage keeps a
receive buffer per micro-batch. Schedules that split the backward keep part of each micro-batch from its weight step
to the end of the step (the Llama family's `split_backward_kept_bytes`; a family that does not say keeps it whole).
tests/cli/test_memory.py and tests/parity/test_parallel.py check every figure against the bytes real runs measure
(train/memory.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from meshformer.config.schema import MeshformerConfig, ModelConfig
from meshformer.config.validate import V_SCHEDULES
from meshformer.dtypes import DTYPE
from meshformer.models.activations import ActivationModel, ActivationShape
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.distill_memory import loss_saved_bytes

# Which dimension of a parameter each tensor-parallel style shards (None: replicated). parallel/tp.py's styles.
TP_SHARD_DIM = {
    "colwise": {"weight": 0, "bias": 0},
    "rowwise": {"weight": 1, "bias": None},
    "vocab_embedding": {"weight": 0},
    "vocab_head": {"weight": 0},
    "rowwise_to_replicated": {"weight": 1, "bias": None},
    "rowwise_full": {"weight": 1, "bias": None},  # shared experts' down projection
}


def _size(dtype_name: str) -> int:
    return torch.empty((), dtype=DTYPE[dtype_name]).element_size()


@dataclass
class StageMemory:
    """Bytes on one rank of a pipeline stage (the most loaded rank where uneven splits differ)."""

    stage: int  # pipeline rank
    layers: int  # decoder layers this rank holds (all its virtual stages)
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # peak of the bytes saved for backward, micro-batches in flight included
    in_flight: int  # micro-batches whose activations this rank holds at once
    recompute_bytes: int = 0  # one recomputed layer's activations, alive again during its backward
    swapped_bytes: int = 0  # activations swapped layers keep in host memory (swap_config), micro-batches in flight
    # autocast's cache holds a compute-dtype copy of every weight it casts until the forward's autocast region ends;
    # a recomputed layer's copies are not saved for backward, so they are counted here, apart from the activations
    autocast_cache_bytes: int = 0
    # the layers' activations were counted on the modules under FakeTensorMode (the family has no activation
    # model: planner/counted_activations.py), not given by a formula
    activations_counted: bool = False

    @property
    def states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + self.activations_bytes + max(self.recompute_bytes, self.autocast_cache_bytes)

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes}


def _local_numel(shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int) -> int:
    shape = list(shape)
    if tp_dim is not None and tp > 1 and shape:
        shape[tp_dim] = math.ceil(shape[tp_dim] / tp)
    if fsdp > 1 and shape:
        shape[0] = math.ceil(shape[0] / fsdp)  # FSDP2 pads dim 0 to equal shards
    return math.prod(shape)


def states_bytes(cfg: MeshformerConfig, dims: ParallelDims, pp_rank: int) -> tuple[int, int, int, int, int]:
    """(parameter, gradient, optimizer-state bytes, decoder layers, local elements of the weights used in matmuls)
    of one rank of pipeline rank `pp_rank`."""
    from meshformer.models.qlora import is_nf4, nf4_local_bytes
    from meshformer.parallel.tp import resolve_plan

    pieces = _pieces(cfg, dims, pp_rank)
    params = grads = optim = layers = matmul = 0
    fsdp = dims.dp_shard if dims.dp_shard > 1 else 1
    for _, piece in pieces:
        styles = resolve_plan(piece, _tp_plan(cfg.model.model_config, piece)) if dims.tp > 1 else {}
        layers += len(piece.layers)
        seen, routed = set(), routed_expert_params(piece)
        for name, p in piece.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            module, _, leaf = name.rpartition(".")
            tp_dim = TP_SHARD_DIM.get(styles.get(module, ""), {}).get(leaf)
            if id(p) in routed:
                numel = expert_local_numel(tuple(p.shape), dims)
            else:
                numel = _local_numel(tuple(p.shape), tp_dim, dims.tp, fsdp)
            nbytes = numel * p.element_size()
            if is_nf4(p):  # a QLoRA base weight: 4-bit codes and their scales (models/qlora.py)
                nbytes = nf4_local_bytes(p, fsdp)
            params += nbytes
            if (
                p.dim() == 2
                and not is_nf4(p)
                and (not name.startswith("embed_tokens") or cfg.model.model_config.tie_word_embeddings)
            ):
                matmul += _local_numel(tuple(p.shape), tp_dim, dims.tp, 1)
            if p.requires_grad:
                # torch's vocab-parallel embedding returns a replicated (whole) gradient for its sharded weight, unless
                # data parallelism (replicate / fully_shard) reduces it into the weight's placement
                replicated = (
                    styles.get(module) == "vocab_embedding"
                    and dims.dp == 1
                    and not cfg.model.model_config.tie_word_embeddings
                )
                grads += math.prod(p.shape) * p.element_size() if replicated else nbytes
                optim += 2 * nbytes + 4  # AdamW: exp_avg, exp_avg_sq, and a float32 step
    return params, grads, optim, layers, matmul


def routed_expert_params(piece) -> set[int]:
    """ids of the routed experts' stacked parameters ([experts, out, in], models/moe/experts.py) in a piece."""
    from meshformer.models.moe.experts import GroupedExperts

    return {id(p) for m in piece.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def expert_local_numel(shape: tuple[int, ...], dims: ParallelDims) -> int:
    """Elements of a stacked routed-expert parameter on one rank: its experts split over `ep` (dim 0), then FSDP
    over `efsdp` when the run shards (dim 1, the features, padded: parallel/data_parallel.py `shard_experts`), else
    whole. Without expert parallelism they are dense parameters."""
    if dims.ep == 1:
        return _local_numel(shape, None, dims.tp, dims.dp_shard if dims.dp_shard > 1 else 1)
    local = [math.ceil(shape[0] / dims.ep), *shape[1:]]
    if dims.dp_shard > 1 and dims.efsdp > 1:
        local[1] = math.ceil(local[1] / dims.efsdp)
    return math.prod(local)


def _layer_matmul_elements(piece, key: str, styles: dict[str, str], tp: int) -> int:
    """Local elements of decoder layer `key`'s matmul weights (its 2-D parameters, tensor-parallel cut by the
    piece's resolved `styles`, whole across FSDP: what autocast casts)."""
    from meshformer.models.qlora import is_nf4

    total = 0
    for name, p in piece.layers[key].named_parameters(prefix=f"layers.{key}"):
        if p.dim() == 2 and not is_nf4(p):  # an NF4 weight is dequantized per use and never saved
            module, _, leaf = name.rpartition(".")
            total += _local_numel(tuple(p.shape), TP_SHARD_DIM.get(styles.get(module, ""), {}).get(leaf), tp, 1)
    return total


def _in_flight(cfg: MeshformerConfig, n_micro: int, pp_rank: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at its peak, by schedule."""
    pc = cfg.parallel_config
    pp = pc.pipeline_stage
    if pp == 1:
        return 1
    if pc.pipeline_schedule in ("gpipe", "looped_bfs"):
        return n_micro
    return min(n_micro, pp - pp_rank)


@dataclass(frozen=True)
class _Regime:
    """What every piece's activation count on this rank shares: the micro-batch's shape and the stream's dtypes."""

    shape: ActivationShape
    tokens: int  # of one micro-batch
    layer_input: int  # bytes of a decoder layer's input (a received pipeline buffer)
    compute: int  # element bytes of compute_dtype
    casts_kept: bool  # autocast's low-precision weight copies live with the activations


def _regime(cfg: MeshformerConfig, dims: ParallelDims, micro_batch: int) -> _Regime:
    mc, pc = cfg.model.model_config, cfg.parallel_config
    dt = {"norm": _size(mc.layernorm_compute_dtype), "compute": _size(mc.compute_dtype)}
    T, tp, sp = micro_batch * mc.seq_length, dims.tp, pc.use_seq_parallel and dims.tp > 1
    # The residual stream is in the stored weights' dtype under autocast (the embedding is not autocast), in the
    # compute dtype when data parallelism gathers low-precision weights (the embedding then returns that dtype).
    autocast = mc.compute_dtype != mc.param_init_type
    gathered_low = autocast and dims.dp > 1  # replicate/fully_shard cast the weights they gather
    residual = dt["compute"] if gathered_low or not autocast else _size(mc.param_init_type)
    casts = residual > dt["compute"]
    # FSDP over the experts' own mesh gathers them in the compute dtype only where it shards or replicates them
    experts_gathered_low = gathered_low and (dims.ep == 1 or dims.efsdp * dims.dp_replicate > 1)
    shape = ActivationShape(
        micro_batch,
        mc.seq_length,
        tp,
        sp,
        dt["norm"],
        dt["compute"],
        residual,
        casts,
        autocast,
        dims.ep,
        expert_copies=autocast and not experts_gathered_low,
        select_policy=cfg.recompute_config.select_recompute_policy,
    )
    layer_input = T * mc.hidden_size * residual // (tp if sp else 1)
    return _Regime(shape, T, layer_input, dt["compute"], autocast and not gathered_low)


@dataclass
class _PieceCount:
    """One pipeline piece's activations for one micro-batch."""

    kept: int = 0  # bytes it leaves saved until its backward
    after_w: int | None = 0  # split-backward schedules: what still lives after its W (None: not modelled)
    swap_host: int = 0  # bytes its swapped layers hold in host memory
    largest: int = 0  # the largest single backward's working set (a recomputed or swapped layer's)
    recast: int = 0  # matmul weight elements whose autocast copies are made again in backward
    counted: bool = False  # counted on the real modules, not by the family's formulas


def _count_piece(cfg, dims, pp_rank: int, s: int, piece, last: bool, model, regime: _Regime, swapped) -> _PieceCount:
    """What piece `s` of this rank saves for one micro-batch, layer by layer under its recompute and swap."""
    from meshformer.parallel.tp import resolve_plan

    mc = cfg.model.model_config
    c = _PieceCount()
    grad = s > 0 or any(p.requires_grad for p in piece.embed_tokens.parameters())
    n_rc, n_sel = _recomputed_layers(cfg, pp_rank, len(piece.layers))
    # the resolved plan is not free (a layout search plans hundreds): only for what asks for it
    wanted = max(n_rc, n_sel) or getattr(model, "needs_styles", True)
    styles = resolve_plan(piece, _tp_plan(mc, piece)) if dims.tp > 1 and wanted else {}
    acts = model.piece_activations(mc, piece, regime.shape, grad, not last, styles)
    c.counted = acts.counted
    cast_bytes = regime.compute * regime.casts_kept
    for i, key in enumerate(piece.layers.keys()):
        la = acts.layers[key]
        full = la.saved
        if int(key) in swapped[0]:  # in host memory; backward holds this layer and the prefetched ones
            c.swap_host += full
            c.largest = max(c.largest, (1 + swapped[1]) * full)
        elif i < n_rc:  # recomputed: keeps its input; its backward holds the full set again, one layer at a time
            c.kept += la.full_recompute
            c.recast += (cast := _layer_matmul_elements(piece, key, styles, dims.tp))
            c.largest = max(c.largest, full + cast * cast_bytes)
            if c.after_w is not None:  # the input outlives W; what the recompute makes dies within I
                c.after_w += la.full_recompute
        elif i < n_sel:  # selective: keeps the matmul, attention and collective outputs
            c.kept += la.selective
            c.recast += (cast := _layer_matmul_elements(piece, key, styles, dims.tp))
            c.largest = max(c.largest, full + cast * cast_bytes)
        else:
            c.kept += full
            if c.after_w is not None:
                c.after_w = None if la.after_w is None else c.after_w + la.after_w
        if n_rc <= i < n_sel or int(key) in swapped[0]:
            c.after_w = None  # selective recompute or swap under a split backward: not modelled (kept whole)
        grad = la.grad_out
    if last:
        _add_head(c, acts.head, loss_saved_bytes(cfg, regime.tokens, math.ceil(mc.vocab_size / dims.tp)))
    return c


def _add_head(c: _PieceCount, head, log_softmax: int) -> None:
    """The last stage's head and the loss's log-softmax (not on W's path; the head's part as its model says)."""
    c.kept += (head.saved if head is not None else 0) + log_softmax
    if c.after_w is not None:
        head_after_w = head.after_w if head is not None else 0
        c.after_w = None if head_after_w is None else c.after_w + head_after_w + log_softmax


def stage_memory(
    cfg: MeshformerConfig, dims: ParallelDims, pp_rank: int, micro_batch: int, n_micro: int
) -> StageMemory:
    """Predicted bytes of one rank of pipeline rank `pp_rank`."""
    pc = cfg.parallel_config
    params, grads, optim, layers, matmul = states_bytes(cfg, dims, pp_rank)
    pieces = _pieces(cfg, dims, pp_rank)
    regime = _regime(cfg, dims, micro_batch)
    n_stages = pc.pipeline_stage * _stages_per_rank(cfg)
    swapped, model = _swapped_layers(cfg, pieces), activation_model(cfg.model.model_config)
    per_stage, buffer = {}, {}  # bytes a micro-batch leaves saved on each stage; a later stage's received input
    after_w, swap_host = {}, {}  # split-backward schedules: what a micro-batch still holds after its W
    # Matmul weight elements of recomputed layers: their autocast copies are not kept but made again in backward,
    # with the layer's activations (the selective policy keeps matmul outputs, not casts).
    largest = recast = 0
    counted = False
    for s, piece in pieces:
        c = _count_piece(cfg, dims, pp_rank, s, piece, s == n_stages - 1, model, regime, swapped)
        counted, largest, recast = counted or c.counted, max(largest, c.largest), recast + c.recast
        per_stage[s], swap_host[s] = c.kept, c.swap_host
        # Every micro-batch's input arrives in a buffer of its own, alive through the step; an in-flight one is
        # its first layer's input (counted in `kept`).
        buffer[s] = regime.layer_input if s > 0 else 0
        # The first stage's W is its whole backward (it has no input gradient to split off): it frees everything.
        after_w[s] = 0 if s == 0 else c.kept if c.after_w is None else c.after_w
    live, k, host = _live_activations(cfg, dims, pp_rank, n_micro, per_stage, buffer, after_w, swap_host)
    activations = live + (n_micro * sum(buffer.values()) if dims.pp > 1 else 0)
    if dims.pp > 1 and pc.pipeline_schedule in V_SCHEDULES and pp_rank == dims.pp - 1:
        # The V's turn: stage pp hands its input gradient to stage pp - 1 on the same rank, and torch keeps each
        # micro-batch's (stage.set_local_bwd_input: grad_recv_info[mb].buffer, never cleared) past the step's end.
        activations += n_micro * regime.layer_input
    if regime.casts_kept:
        activations += (matmul - recast) * regime.compute  # autocast's low-precision weight copies, one per region
    cache = recast * regime.compute if regime.casts_kept else 0
    return StageMemory(pp_rank, layers, params, grads, optim, activations, k, largest, host, cache, counted)


def _live_activations(cfg, dims, pp_rank: int, n_micro: int, per_stage, buffer, after_w, swap_host):
    """(peak activation bytes alive on this rank, micro-batches in flight at it, host bytes of swapped layers):
    replayed from the pipeline schedule's actions, or k in flight times each stage's share without one."""
    pc = cfg.parallel_config
    actions = None
    if dims.pp > 1:
        from meshformer.parallel.pipeline import stage_ids
        from meshformer.planner.schedule import peak_live, rank_actions

        actions = rank_actions(
            pc.pipeline_schedule, dims.pp, _stages_per_rank(cfg), n_micro, pp_rank, tuple(stage_ids(cfg, pp_rank))
        )
    if actions is not None:
        live, k = peak_live(
            actions,
            {s: per_stage[s] - buffer[s] for s in per_stage},
            {s: max(0, after_w[s] - buffer[s]) for s in per_stage},
        )
        host, _ = peak_live(actions, swap_host)
        return live, k, host
    k = _in_flight(cfg, n_micro, pp_rank)
    return sum(k * (per_stage[s] - buffer[s]) for s in per_stage), k, k * sum(swap_host.values())


def activation_model(mc: ModelConfig) -> ActivationModel:
    """The family's activation model (models/registry.py: ModelFamily.activation_model), or the counter that
    measures one forward of the real modules on fake tensors where the family has none."""
    from meshformer.models.registry import family_of

    model = family_of(mc).activation_model
    if model is None:
        from meshformer.planner.counted_activations import COUNTED

        return COUNTED
    return model


def _tp_plan(mc: ModelConfig, piece) -> dict[str, str]:
    from meshformer.models.registry import family_of

    return family_of(mc).tp_plan(piece)


def _swapped_layers(cfg: MeshformerConfig, pieces: list) -> tuple[set[int], int]:
    """(global indices of this rank's layers that swap to host memory, layers prefetched ahead)."""
    from meshformer.parallel.swap import swapped_layers

    ids = [int(k) for _, piece in pieces for k in piece.layers.keys()]
    return swapped_layers(cfg.swap_config, ids)


def _pieces(cfg: MeshformerConfig, dims: ParallelDims, pp_rank: int) -> list:
    """(stage index, meta-device module) of every stage this pipeline rank holds, model transforms applied. Cached
    by what decides them (the model and its transforms, the pipeline cut): a layout search plans hundreds."""
    import yaml

    from meshformer.config.load import to_dict

    pc = cfg.parallel_config
    key = (
        yaml.safe_dump(to_dict(cfg.model), sort_keys=True),
        dims.pp,
        pc.pp_interleave_num,
        pc.pipeline_schedule,
        str(cfg.model.model_config.offset),
        pp_rank,
    )
    if key not in _PIECES:
        from meshformer.models import build_model
        from meshformer.models.transforms import apply_model_transforms
        from meshformer.parallel.pipeline import split_pipeline

        model = build_model(cfg.model.model_config)
        apply_model_transforms(model, cfg)
        if len(_PIECES) > 64:
            _PIECES.clear()
        _PIECES[key] = split_pipeline(model, cfg, pp_rank) if dims.pp > 1 else [(0, model)]
    return _PIECES[key]


_PIECES: dict = {}


def _stages_per_rank(cfg: MeshformerConfig) -> int:
    from meshformer.config.validate import stages_per_rank

    return stages_per_rank(cfg)


def _recomputed_layers(cfg: MeshformerConfig, pp_rank: int, layers: int) -> tuple[int, int]:
    """(layers fully recomputed, layers up to which the rest are selectively recomputed) of one part."""
    from meshformer.parallel.recompute import _count, selective_plan

    rc = cfg.recompute_config
    return _count(rc.recompute, pp_rank, layers), selective_plan(rc.select_recompute, pp_rank, layers)[0]


def plan_memory(cfg: MeshformerConfig, dims: ParallelDims, micro_batch: int, n_micro: int) -> list[StageMemory]:
    """Every pipeline rank's predicted memory (one entry without pipeline parallelism)."""
    return [stage_memory(cfg, dims, r, micro_batch, n_micro) for r in range(dims.pp)]
