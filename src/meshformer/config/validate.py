"""Cross-field rules: the model's shape and the parallel layout must fit together.

All of these run before any process group exists, so a bad layout costs one line and exit code 2,
never a hang in a collective.
"""

from __future__ import annotations

import re

from meshformer.config.distill_schema import check_distill
from meshformer.config.fp8_schema import check_fp8
from meshformer.config.preference_schema import check_preference
from meshformer.config.scale_sense import scale_sense
from meshformer.config.schema import MeshformerConfig, ModelConfig
from meshformer.config.tracker_schema import report_to_names
from meshformer.errors import UserError

# Schedules that need at least as many micro-batches as pipeline stages.
STEADY_STATE_SCHEDULES = ("1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
# Schedules that split each backward into an input half and a weight half, per autograd node (torch's
# stage_backward_input / stage_backward_weight).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stages_per_rank(cfg: MeshformerConfig) -> int:
    pc = cfg.parallel_config
    if pc.pipeline_schedule in V_SCHEDULES:
        return 2
    return pc.pp_interleave_num if pc.pipeline_schedule in MULTI_STAGE_SCHEDULES else 1


def validate_config(cfg: MeshformerConfig) -> None:
    mc = cfg.model.model_config
    if mc.heads_are_dim_per_head:  # else the family's attention has widths of its own, checked in its validate
        check_head_width(mc)
    if mc.num_heads % mc.num_kv_heads:
        raise UserError(
            f"model.model_config.n_kv_heads={mc.n_kv_heads} must divide num_heads={mc.num_heads}: "
            f"choose from {_divisors(mc.num_heads)}"
        )
    if mc.rms_norm_eps >= 1:
        raise UserError(f"model.model_config.rms_norm_eps={mc.rms_norm_eps} is too large: use a small value like 1e-5")
    if mc.pet_method in ("lora", "qlora"):  # the short form switches LoRA on with pet_config's (default) settings
        mc.pet_config.pet_type = "lora"
    if mc.pet_method == "qlora":
        mc.pet_config.quantize_base = "nf4"
    check_quantized_base(cfg)
    widest = max(mc.hidden_size, mc.num_heads * mc.dim_per_head, mc.ffn_hidden_size)
    if mc.pet_config.pet_type == "lora" and mc.pet_config.lora_rank > widest:
        # B A has rank at most min(d_out, d_in): a larger r only allocates (r = 10**9 asked for 128 GB at once)
        raise UserError(
            f"model.model_config.pet_config.lora_rank={mc.pet_config.lora_rank} is wider than any linear of the model "
            f"(at most {widest}): a rank above a linear's width adds nothing; use e.g. 8 to 64"
        )
    mc.validate(cfg)  # the family's own rules (its config class, in its folder)
    validate_layout(cfg, world_size=None)
    pp = cfg.parallel_config.pipeline_stage
    sel = cfg.recompute_config.select_recompute
    counts = {"recompute": cfg.recompute_config.recompute, "select_recompute": sel}
    if isinstance(sel, dict):
        counts |= {f"select_recompute[{k!r}]": v for k, v in sel.items() if not isinstance(v, bool)}
    for name, rc in counts.items():
        if isinstance(rc, list) and (len(rc) != pp or not all(isinstance(x, int) and x >= 0 for x in rc)):
            raise UserError(
                f"recompute_config.{name}={rc}: give one non-negative layer count per pipeline stage "
                f"({pp} numbers), or true/false"
            )
    if isinstance(sel, dict):
        check_select_recompute(sel)
    check_swap(cfg)
    check_compile(cfg)
    check_preference(cfg)
    cfg.report_to = report_to_names(cfg.report_to)  # one list of tracker names, whichever spelling
    check_distill(cfg)
    check_fp8(cfg)
    if cfg.profile and cfg.profile_stop_step < cfg.profile_start_step:
        raise UserError(
            f"profile_stop_step={cfg.profile_stop_step} is before profile_start_step={cfg.profile_start_step}: "
            "give a window with start <= stop"
        )
    ls = cfg.lr_schedule
    peak = ls.learning_rate if ls.learning_rate is not None else cfg.optimizer.learning_rate
    if ls.lr_end > peak:  # the "decay" would climb from the peak to lr_end
        raise UserError(
            f"lr_schedule.lr_end={ls.lr_end:g} is above the peak learning rate {peak:g}: give an lr_end <= the peak "
            "(0 decays to nothing)"
        )
    if ls.total_steps == 0 or ls.total_steps < -1:
        raise UserError(
            f"lr_schedule.total_steps={ls.total_steps}: give a positive step count, or -1 for the run's length"
        )
    betas = cfg.optimizer.betas
    numbers = betas is not None and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)
    if betas is not None and (len(betas) != 2 or not numbers or not all(0 <= b < 1 for b in betas)):
        # torch.optim.AdamW refuses a beta of 1 (its bias correction divides by 1 - beta**step)
        raise UserError(f"optimizer.betas={betas}: give two numbers in [0, 1), e.g. [0.9, 0.95]")
    for i, cb in enumerate(cfg.callbacks):
        if cb.type == "CheckpointMonitor" and cb.keep_checkpoint_max < 1:
            raise UserError(f"callbacks.{i}.keep_checkpoint_max must be at least 1")


def check_head_width(mc: ModelConfig) -> None:
    """The per-head width of grouped-query attention: whole, and even (rotary embeddings turn pairs of channels)."""
    if mc.head_dim is None and mc.hidden_size % mc.num_heads:
        raise UserError(
            f"model.model_config.hidden_size={mc.hidden_size} is not divisible by num_heads={mc.num_heads}: "
            f"set head_dim, or pick num_heads from {_divisors(mc.hidden_size)[:12]}"
        )
    if mc.dim_per_head % 2:
        field = (
            f"head_dim={mc.head_dim}"
            if mc.head_dim is not None
            else f"hidden_size / num_heads = {mc.hidden_size} / {mc.num_heads} = {mc.dim_per_head} (the head width)"
        )
        raise UserError(
            f"model.model_config.{field} must be even for rotary embeddings (they turn pairs of channels): set an "
            f"even head_dim{'' if mc.head_dim is not None else ', or another num_heads'}"
        )


# MindSpore select_recompute dict keys name cells and operators (`feed_forward\.mul`). Every one of them is
# element-wise work meshformer's selective policy recomputes anyway (parallel/recompute.py), so a dict decides
# which layers, not which operations; a key naming none of them is probably a typo.
SELECT_RECOMPUTE_OPS = ("mul", "silu", "activation", "reshape", "add", "norm", "cast", "softmax")


def check_compile(cfg: MeshformerConfig) -> None:
    """compile: the layouts where per-layer torch.compile is not proven are refused, each with its reason."""
    if cfg.compile is not True:  # auto decides per device and layout (parallelize.compile_decision)
        return
    if cfg.swap_config.swap:
        raise UserError(
            "compile: true with swap_config.swap: the swap's saved-tensor hooks cannot run inside a compiled layer: "
            "choose one"
        )


def check_swap(cfg: MeshformerConfig) -> None:
    """swap_config: whole layers only, by valid global indices."""
    sc, n = cfg.swap_config, cfg.model.model_config.num_layers
    if sc.op_swap:
        raise UserError(
            "swap_config.op_swap: meshformer swaps whole layers, not single operators: use swap_config.layer_swap "
            "(e.g. [{layers: [0, 1], backward_prefetch: 1}])"
        )
    for i, entry in enumerate(sc.layer_swap or []):
        where = f"swap_config.layer_swap[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"layers", "backward_prefetch"}:
            raise UserError(f"{where}={entry!r}: give {{layers: true or [layer indices], backward_prefetch: n}}")
        layers, pre = entry.get("layers", True), entry.get("backward_prefetch", 1)
        if layers is not True and not (
            isinstance(layers, list)
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in layers)
        ):
            raise UserError(f"{where}.layers={layers!r}: give true or a list of layer indices in [0, {n})")
        if not isinstance(pre, int) or isinstance(pre, bool) or pre < 1:
            raise UserError(f"{where}.backward_prefetch={pre!r}: give a whole number of layers, at least 1")


def check_select_recompute(select: dict) -> None:
    for pattern in select:
        if not any(re.search(rf"\b{w}\b", str(pattern).replace("\\", "")) for w in SELECT_RECOMPUTE_OPS):
            raise UserError(
                f"recompute_config.select_recompute: {pattern!r} names no operation meshformer can recompute "
                f"selectively: use keys naming {', '.join(SELECT_RECOMPUTE_OPS)} (e.g. 'feed_forward\\.mul'), or true"
            )


def validate_run(cfg: MeshformerConfig, world_size: int | None) -> None:
    """Everything a run needs beyond a loadable config: the layout against the world size, and the settings
    meshformer reads but cannot train with yet. `config check`, `launch` and every rank call it before any
    process group exists."""
    validate_layout(cfg, world_size)
    mc, pc = cfg.model.model_config, cfg.parallel_config
    if cfg.run_mode == "predict":
        raise UserError(
            "run_mode=predict: training configs train; to predict, run "
            "`meshformer generate --checkpoint OUTPUT_DIR --prompt TEXT`"
        )
    if cfg.run_mode == "eval":
        raise UserError(
            "run_mode=eval: training configs train; to evaluate a checkpoint on text run "
            "`meshformer eval --checkpoint DIR --input FILE`, or evaluate during training with "
            "eval_config.eval_interval and do_eval: true"
        )
    sharded = cfg.optimizer.optimizer_parallel > 1 or (
        (pc.optimizer_shard or cfg.parallel.enable_parallel_optimizer) and pc.data_parallel > 1
    )
    if pc.cpu_offload and not sharded:
        raise UserError(
            "parallel_config.cpu_offload=true offloads FSDP's shards, and this layout shards nothing: set "
            "parallel_config.optimizer_shard: true with data_parallel > 1, or cpu_offload: false"
        )
    scale_sense(cfg)  # a malformed runner_wrapper.scale_sense is one line here, before any process
    check_benchmark_layout(cfg)
    if mc.tie_word_embeddings and pc.pipeline_stage > 1:
        raise UserError(
            "model.model_config.tie_word_embeddings=true cannot be split by pipeline_stage="
            f"{pc.pipeline_stage} (the embedding and output projection would live on different stages): "
            "set tie_word_embeddings: false, or use data_parallel/model_parallel instead of pipeline_stage"
        )
    for name in ("train_dataset", "eval_dataset"):
        if getattr(cfg, name).data_loader.packing and pc.pipeline_stage > 1:
            raise UserError(
                f"{name}.data_loader.packing=true is not supported with parallel_config.pipeline_stage="
                f"{pc.pipeline_stage} yet (the stages would need each row's document layout): set packing: false "
                f"(one padded sample per row), or use data_parallel/model_parallel instead of pipeline_stage"
            )
    if mc.compute_dtype == "float32" and mc.param_init_type != "float32":
        raise UserError(
            f"model.model_config.compute_dtype=float32 is wider than param_init_type="
            f"{mc.param_init_type}: use compute_dtype: {mc.param_init_type}, or param_init_type: float32"
        )


def check_benchmark_layout(cfg: MeshformerConfig) -> None:
    """eval_config.tasks runs lm-eval on the training model (train/benchmarks.py): every rank must give a batch's
    whole logits, and generate through its KV cache, in plain forwards. Data parallel and FSDP do; a pipeline stage
    holds a part of the model (its logits come out of a schedule over all stages), tensor parallel splits the
    logits and the attention heads the KV cache is made for, context parallel splits each sequence and expert
    parallel routes tokens between ranks: refused, with the ways that work."""
    pc = cfg.parallel_config
    why = {
        "pipeline_stage": "each rank holds only its stages of the model",
        "model_parallel": "the logits and the attention heads (the KV cache's) are split over ranks",
        "context_parallel": "each sequence is split over ranks",
        "expert_parallel": "tokens are routed to experts on other ranks",
    }
    over = [(k, getattr(pc, k)) for k in why if getattr(pc, k) > 1]
    if cfg.eval_config.tasks and over:
        name, degree = over[0]
        raise UserError(
            f"eval_config.tasks with parallel_config.{name}={degree}: lm-eval tasks need the whole model on every "
            f"rank, and under {name} {why[name]}: leave eval_config.tasks empty and run "
            "`meshformer eval --checkpoint DIR --tasks ...` on a saved checkpoint (under torchrun it splits the "
            "documents over ranks), or train with data_parallel (optimizer_shard or not) only"
        )
    limit = cfg.eval_config.limit
    if cfg.eval_config.tasks and limit is not None and 1 <= limit < pc.data_parallel:
        raise UserError(  # a rank with no document would skip the forwards the other ranks wait on
            f"eval_config.limit {limit:g} is below parallel_config.data_parallel={pc.data_parallel}: each "
            f"data-parallel rank scores its share of a task's documents, so give at least {pc.data_parallel}"
        )


def validate_layout(cfg: MeshformerConfig, world_size: int | None) -> None:
    """The parallel degrees against the model and (when known) the number of processes."""
    pc, mc = cfg.parallel_config, cfg.model.model_config
    check_not_yet(cfg)
    check_expert_parallel(cfg)
    dp, tp, pp, cp = pc.data_parallel, pc.model_parallel, pc.pipeline_stage, pc.context_parallel
    if world_size is not None and dp * tp * pp * cp != world_size:
        rest = world_size // cp if world_size % cp == 0 else world_size  # the alternatives keep cp when they can
        alts = [
            f"dp{d}xmp{t}xpp{p}" + (f"xcp{cp}" if rest != world_size else "")
            for t in _divisors(rest)
            for p in _divisors(rest // t)
            for d in [rest // (t * p)]
            if _tp_fits(mc, t) and p <= mc.num_layers
        ]
        names, shape = "data_parallel x model_parallel x pipeline_stage", f"{dp}x{tp}x{pp}"
        if cp > 1:
            names, shape = names + " x context_parallel", shape + f"x{cp}"
        raise UserError(
            f"parallel_config: {names} = {shape} = {dp * tp * pp * cp} "
            f"but {world_size} processes were started: use e.g. {', '.join(alts[:6])}"
        )
    if tp > 1:
        ffn = mc.ffn_hidden_size
        for name, n in (("num_heads", mc.num_heads), ("n_kv_heads", mc.num_kv_heads), ("intermediate_size", ffn)):
            if n % tp:
                valid = [d for d in _divisors(mc.num_heads) if _tp_fits(mc, d)]
                raise UserError(
                    f"parallel_config.model_parallel={tp} does not divide {name}={n}: "
                    f"valid model_parallel degrees for this model are {valid}"
                )
    if pp > 1:
        n_stages = pp * stages_per_rank(cfg)
        if n_stages > mc.num_layers:
            raise UserError(
                f"parallel_config.pipeline_stage={pp} ({n_stages} stages) exceeds num_layers={mc.num_layers}: "
                f"use at most {mc.num_layers // stages_per_rank(cfg)} stages or more layers"
            )
        if pc.pipeline_schedule in STEADY_STATE_SCHEDULES and pc.micro_batch_num < pp:
            raise UserError(
                f"parallel_config.micro_batch_num={pc.micro_batch_num} is smaller than pipeline_stage={pp}, "
                f"which {pc.pipeline_schedule} needs: set micro_batch_num >= {pp} (4-8x is typical), "
                f"or pipeline_schedule: gpipe"
            )
        if (
            pc.pipeline_schedule in MULTI_STAGE_SCHEDULES
            and pc.pipeline_schedule not in V_SCHEDULES
            and pc.pp_interleave_num < 2
        ):
            raise UserError(f"parallel_config.pipeline_schedule={pc.pipeline_schedule} needs pp_interleave_num >= 2")
        if pc.pipeline_schedule in ("interleaved_1f1b",) and pc.micro_batch_num % pp:
            raise UserError(
                f"parallel_config.micro_batch_num={pc.micro_batch_num} must be a multiple of "
                f"pipeline_stage={pp} for interleaved_1f1b"
            )
        stage_layer_counts(cfg)  # raises on a bad offset
    op = cfg.optimizer.optimizer_parallel
    if op and dp % op:
        raise UserError(
            f"optimizer.optimizer_parallel={op} must divide data_parallel={dp}: choose from {_divisors(dp)}"
        )


def check_not_yet(cfg: MeshformerConfig) -> None:
    """Degrees whose mesh is laid out (parallel/dims.py) but whose technique does not run yet in this combination:
    refused first, one line each."""
    check_context_parallel(cfg)


# What context parallelism is proven with (tests/parity/test_context_parallel.py); each other combination is refused.
CP_ALGOS = ("colossalai_cp",)


def check_context_parallel(cfg: MeshformerConfig) -> None:
    """context_parallel (cp) splits every row over cp ranks in 2·cp chunks (parallel/context_parallel.py): the row
    must split evenly, and the combinations not proven yet are refused."""
    pc, mc = cfg.parallel_config, cfg.model.model_config
    cp = pc.context_parallel
    if cp == 1:
        return
    head = f"parallel_config.context_parallel={cp}"
    if pc.context_parallel_algo not in CP_ALGOS:
        raise UserError(
            f"parallel_config.context_parallel_algo={pc.context_parallel_algo} is not yet supported: use "
            f"colossalai_cp (all-gathered keys and values, load-balanced chunks)"
        )
    if mc.seq_length % (2 * cp):
        fits = [d for d in _divisors(mc.seq_length // 2) if d > 1][:6]
        raise UserError(
            f"{head}: model.model_config.seq_length={mc.seq_length} does not split into 2 x {cp} = {2 * cp} equal "
            f"chunks: make seq_length a multiple of {2 * cp}, or choose context_parallel from {fits}"
        )
    not_yet = [
        (cfg.compile is True, "compile: true", "compile: auto or false"),
        (cfg.swap_config.swap, "swap_config.swap: true", "recompute_config.recompute"),
    ]
    for bad, what, fix in not_yet:
        if bad:
            raise UserError(f"{head} with {what} is not yet supported: use {fix}, or context_parallel: 1")


def check_quantized_base(cfg: MeshformerConfig) -> None:
    """An NF4 base (QLoRA) is the frozen base of LoRA adapters, and takes no tensor parallelism."""
    mc = cfg.model.model_config
    if mc.pet_config.quantize_base == "none":
        return
    if mc.pet_config.pet_type != "lora":
        raise UserError(
            f"model.model_config.pet_config.quantize_base={mc.pet_config.quantize_base} quantizes the frozen base of "
            f"LoRA adapters: set pet_config.pet_type: lora (or model_config.pet_method: qlora)"
        )
    if cfg.parallel_config.model_parallel > 1:
        raise UserError(
            f"model.model_config.pet_config.quantize_base={mc.pet_config.quantize_base} with parallel_config."
            f"model_parallel={cfg.parallel_config.model_parallel}: an NF4 weight splits only by rows into whole "
            f"blocks, a row-parallel linear would cut them; use data_parallel (with optimizer_shard) instead"
        )
    shard, dp = shard_degree(cfg), cfg.parallel_config.data_parallel
    if 1 < shard < dp:  # torchao's NF4 all-gather takes a 1-D mesh
        raise UserError(
            f"model.model_config.pet_config.quantize_base={mc.pet_config.quantize_base} with optimizer_parallel="
            f"{shard} of data_parallel={dp} (HSDP): the NF4 base shards over one mesh dimension only; shard over "
            f"all data-parallel ranks (optimizer_parallel: {dp}) or none"
        )


def shard_degree(cfg: MeshformerConfig) -> int:
    """Size of the optimizer-shard (FSDP) group; 1 means plain replicated data parallel (DDP)."""
    pc = cfg.parallel_config
    op = cfg.optimizer.optimizer_parallel
    if op > 0:
        return op
    if pc.optimizer_shard or cfg.parallel.enable_parallel_optimizer:
        return pc.data_parallel
    return 1


def check_expert_parallel(cfg: MeshformerConfig) -> None:
    """expert_parallel (ep) splits each MoE layer's experts over ranks it borrows from the parameter-sharding
    data-parallel ranks x context_parallel (parallel/dims.py): it needs routed experts, must divide their number,
    and must divide the ranks it borrows. Tensor-parallel ranks are not borrowed: experts stay whole on each."""
    pc, mc = cfg.parallel_config, cfg.model.model_config
    ep = pc.expert_parallel
    if ep == 1:
        return
    if not mc.is_moe:
        experts = mc.moe_config.expert_num if hasattr(mc, "moe_config") else 1
        raise UserError(
            f"parallel_config.expert_parallel={ep} but the model is dense (model.model_config.moe_config.expert_num="
            f"{experts}): set expert_parallel: 1, or train an MoE model"
        )
    m = mc.moe_config
    if m.expert_num % ep:
        raise UserError(
            f"parallel_config.expert_parallel={ep} must divide moe_config.expert_num={m.expert_num}: choose "
            f"expert_parallel from {_divisors(m.expert_num)}"
        )
    borrowed = shard_degree(cfg) * pc.context_parallel
    if borrowed % ep:
        raise UserError(
            f"parallel_config.expert_parallel={ep} must divide the ranks it borrows, the parameter-sharding data-"
            f"parallel ranks x context_parallel = {borrowed}: set parallel_config.optimizer_shard: true with "
            f"data_parallel a multiple of {ep} (or optimizer.optimizer_parallel), or choose expert_parallel from "
            f"{[d for d in _divisors(borrowed) if m.expert_num % d == 0]}"
        )


def _tp_fits(mc: ModelConfig, t: int) -> bool:
    return mc.num_heads % t == 0 and mc.num_kv_heads % t == 0 and mc.ffn_hidden_size % t == 0


def stage_layer_counts(cfg: MeshformerConfig) -> list[int]:
    """Layers per pipeline stage: even split, adjusted by model_config.offset (MindSpore semantics)."""
    mc, pc = cfg.model.model_config, cfg.parallel_config
    n = pc.pipeline_stage * stages_per_rank(cfg)
    base, extra = divmod(mc.num_layers, n)
    counts = [base + (1 if i >= n - extra else 0) for i in range(n)]  # leftovers go to later stages
    off = mc.offset
    if isinstance(off, list):
        if len(off) != n or not all(isinstance(o, int) for o in off):
            raise UserError(f"model.model_config.offset={off}: give {n} integers (one per stage) or 0")
        counts = [base + o for o in off]
        if sum(counts) != mc.num_layers or min(counts) < 1:
            raise UserError(
                f"model.model_config.offset={off} gives stage sizes {counts}: they must be >= 1 and sum "
                f"to num_layers={mc.num_layers} (offsets must sum to {mc.num_layers - base * n})"
            )
    elif off != 0:
        raise UserError(f"model.model_config.offset={off}: use 0 (even split) or a list of {n} per-stage adjustments")
    return counts
