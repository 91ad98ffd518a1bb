"""The whole configuration schema, in one place.

Field names follow MindSpore Transformers (the seed article and `shared/reference/mindformers-configs`) so
that users can bring their YAML files. Every field carries a one-line doc (`meta["doc"]`) that is also the
CLI help (`meshformer config explain`). Validation of single values (type, range, choices) is driven by the
metadata here; cross-field rules live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def setting(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A schema field: default, one-line doc, and the value checks the loader applies."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    if isinstance(default, type) and hasattr(default, "__dataclass_fields__"):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RopeScalingConfig:
    type: str = setting(
        "none", "Rotary scaling: none, or llama3 (Llama 3.1 frequency-dependent scaling).", choices=("none", "llama3")
    )
    factor: float = setting(8.0, "llama3 scaling: overall context extension factor.", gt=0)
    low_freq_factor: float = setting(1.0, "llama3 scaling: low-frequency wavelength factor.", gt=0)
    high_freq_factor: float = setting(4.0, "llama3 scaling: high-frequency wavelength factor.", gt=0)
    original_max_position_embeddings: int = setting(8192, "llama3 scaling: context length of the unscaled model.", gt=0)


@dataclass
class PetConfig:
    pet_type: str = setting(
        "none", "Parameter-efficient fine-tuning: none, or lora (low-rank adapters).", choices=("none", "lora")
    )
    lora_rank: int = setting(
        8, "LoRA rank r: the adapter of a d_out x d_in linear is B (d_out x r) A (r x d_in).", gt=0
    )
    lora_alpha: float = setting(16.0, "LoRA scale numerator: the adapter adds (lora_alpha / lora_rank) B A x.", gt=0)
    lora_dropout: float = setting(0.0, "Dropout on the adapter's input (training only).", ge=0, le=0.9)
    target_modules: str | list = setting(
        ".*q_proj|.*k_proj|.*v_proj|.*o_proj",
        "Linears to adapt: a regex over module paths (MindSpore's wq wk wv wo w1 w2 w3 work) or a list of names.",
    )
    freeze_include: list = setting([], "Freeze parameters whose names match these globs, e.g. ['embed_tokens.*'].")
    freeze_exclude: list = setting([], "...except those matching these globs (they stay trainable).")


class RegisteredNames:
    """Choices that a registry outside config/ fills as it registers names (models/registry.py adds each model
    family's config types): the models import this schema, so the schema may not import them. While nothing is
    registered (meshformer.models not imported yet) the loader has no list to check against and the registry's own
    lookup (`family_of`) refuses an unknown name instead, in the same words; the CLI imports the models first."""

    def __init__(self) -> None:
        self._names: list[str] = []

    def add(self, names) -> None:
        self._names.extend(n for n in names if n not in self._names)

    def discard(self, names) -> None:
        self._names = [n for n in self._names if n not in names]

    def __iter__(self):
        return iter(list(self._names))

    def __contains__(self, value) -> bool:
        return value in self._names

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return repr(tuple(self._names))


MODEL_TYPES = RegisteredNames()  # model_config.type's choices (models/registry.py register_family)


@dataclass
class ModelConfig:
    type: str = setting(
        "LlamaConfig",
        "Architecture family: LlamaConfig, Qwen2Config (q/k/v bias on by default) or Qwen3Config (q/k norm on).",
        choices=MODEL_TYPES,
    )
    seq_length: int = setting(2048, "Tokens per training sample (the context length trained on).", gt=0)
    hidden_size: int = setting(4096, "Model width (embedding dimension).", gt=0)
    num_layers: int = setting(32, "Number of decoder layers.", gt=0)
    num_heads: int = setting(32, "Attention (query) heads; model_parallel must divide it.", gt=0)
    n_kv_heads: int | None = setting(None, "Key/value heads for grouped-query attention (default: num_heads).", gt=0)
    head_dim: int | None = setting(None, "Per-head width (default: hidden_size / num_heads).", gt=0)
    intermediate_size: int | None = setting(
        None, "SwiGLU hidden width (default: Llama rule from multiple_of and ffn_dim_multiplier).", gt=0
    )
    multiple_of: int = setting(256, "Round the default intermediate_size up to a multiple of this.", gt=0)
    ffn_dim_multiplier: float | None = setting(
        None, "Scale the default intermediate_size by this factor (at most 100).", gt=0, le=100
    )
    vocab_size: int = setting(32000, "Vocabulary size; must be at least the tokenizer's vocabulary.", gt=0)
    rms_norm_eps: float = setting(1e-5, "Epsilon of every RMSNorm.", gt=0)
    theta: float = setting(10000.0, "Rotary embedding base frequency.", gt=0, aliases=("rotary_emb_base",))
    rope_scaling: RopeScalingConfig = setting(RopeScalingConfig, "Optional rotary frequency scaling (llama3 style).")
    max_position_embedding: int | None = setting(
        None,
        "Longest context the model is made for (Hugging Face max_position_embeddings; default seq_length).",
        gt=0,
        aliases=("max_position_embeddings",),
    )
    tie_word_embeddings: bool = setting(False, "Share the input embedding matrix with the output projection.")
    qkv_has_bias: bool = setting(False, "Add a bias to the q/k/v projections (Qwen2).")
    use_qk_norm: bool = setting(False, "RMSNorm on each query and key head before rotary (Qwen3).")
    compute_dtype: str = setting(
        "float32", "Dtype of matmuls and activations (bfloat16 for mixed precision).", choices=DTYPES
    )
    layernorm_compute_dtype: str = setting(
        "float32",
        "Dtype RMSNorm computes in (keep float32 for stability).",
        choices=DTYPES,
        aliases=("layernorm_compute_type",),
    )
    softmax_compute_dtype: str = setting(
        "float32",
        "Dtype of the loss's log-softmax (attention kernels accumulate softmax in fp32).",
        choices=DTYPES,
        aliases=("softmax_compute_type",),
    )
    rotary_dtype: str = setting("float32", "Dtype the rotary cos/sin tables are computed in.", choices=DTYPES)
    param_init_type: str = setting(
        "float32", "Dtype parameters are stored in (the master weights).", choices=DTYPES, aliases=("params_dtype",)
    )
    init_std: float = setting(0.02, "Standard deviation of the normal weight initialisation.", gt=0)
    bos_token_id: int | None = setting(None, "Beginning-of-sequence id (default: the tokenizer's).")
    eos_token_id: int | None = setting(None, "End-of-sequence id (default: the tokenizer's).")
    pad_token_id: int | None = setting(None, "Padding id (default: the tokenizer's).")
    ignore_token_id: int = setting(
        -100, "Label value that the loss ignores (a 64-bit integer).", ge=-(2**63), le=2**63 - 1
    )
    pet_config: PetConfig = setting(PetConfig, "Parameter-efficient fine-tuning (pet_type: lora).")
    pet_method: str = setting(
        "none", "Short form of pet_config.pet_type (the seed's `pet_method: lora`).", choices=("none", "lora")
    )
    offset: int | list = setting(0, "Pipeline layer split: 0 for even, or a list of per-stage layer-count adjustments.")

    # Derived shapes: what the optional fields above resolve to. Every consumer (model, validation, metrics,
    # planner, conversion) reads these, so a default rule lives in one place.
    @property
    def num_kv_heads(self) -> int:
        """Key/value heads actually built: n_kv_heads, else num_heads (no grouping)."""
        return self.n_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        """Per-head width actually built: head_dim, else hidden_size / num_heads."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def ffn_hidden_size(self) -> int:
        """SwiGLU width actually built: intermediate_size, else Llama's rule (2/3 of 4h, scaled by
        ffn_dim_multiplier, rounded up to multiple_of)."""
        if self.intermediate_size:
            return self.intermediate_size
        hidden = int(2 * 4 * self.hidden_size / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


@dataclass
class ModelArchConfig:
    type: str = setting(
        "LlamaForCausalLM", "Model class (LlamaForCausalLM is the only causal LM head).", choices=("LlamaForCausalLM",)
    )


@dataclass
class ModelSection:
    model_config: ModelConfig = setting(ModelConfig, "Architecture and numerics of the network.")
    arch: ModelArchConfig = setting(ModelArchConfig, "Model head class.")


class RegisteredDatasetFormats:
    """`data_loader.type`'s choices: the dataset formats registered when the value is checked (data/registry.py; a
    format registered at run time is accepted). Imported when first checked: the data modules import no config,
    so this is a dependency one way, not a cycle."""

    def _names(self) -> list[str]:
        from meshformer.data.registry import dataset_formats

        return dataset_formats()

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, value) -> bool:
        return value in self._names()

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(tuple(self._names()))


@dataclass
class DataLoaderConfig:
    type: str = setting(
        "MindDataset",
        "Dataset format: MindDataset (a `meshformer preprocess` directory) or any name registered with "
        "data/registry.py register_dataset_format.",
        choices=RegisteredDatasetFormats(),
    )
    dataset_dir: str = setting("", "Directory written by `meshformer preprocess`.")
    tokenizer: str = setting(
        "",
        "The data's tokenizer.json, or a folder holding it (default: processor.tokenizer, else the dataset's "
        "own); saved with every checkpoint. eval_dataset's, if set, must be the same.",
    )
    shuffle: bool = setting(True, "Shuffle sample order each epoch (the order is derived from seed, so resumable).")
    packing: bool = setting(
        False,
        "Instruction data: pack several samples per row, attention and rotary positions restarting at each "
        "(document masking); false pads one sample per row.",
    )


@dataclass
class DatasetConfig:
    data_loader: DataLoaderConfig = setting(DataLoaderConfig, "Where the tokens come from.")
    batch_size: int | None = setting(
        None,
        "Micro-batch size: samples per forward pass on each data-parallel rank (train_dataset default: "
        "runner_config.batch_size, else 1; eval_dataset default: the training micro-batch).",
        gt=0,
    )
    drop_remainder: bool = setting(
        True,
        "MindSpore batching flag (accepted; training always drops an epoch's incomplete "
        "last global batch, evaluation reads whole micro-batches).",
    )
    split: str | None = setting(
        None,
        "Split of the dataset directory to read (default: train for train_dataset, validation for eval_dataset).",
        choices=("train", "validation"),
    )
    num_parallel_workers: int = setting(
        1,
        "Threads building the next prefetch_size batches in the background (batches are a pure function of "
        "the step: samples and order do not change).",
        gt=0,
    )
    prefetch_size: int = setting(
        1,
        "Batches built ahead of their step (0: on the main thread when the step starts); on a GPU they wait "
        "in pinned memory and copy without blocking.",
        ge=0,
    )


@dataclass
class TokenizerConfig:
    tokenizer_file: str = setting(
        "", "Hugging Face tokenizer.json the data was made with (a folder holding one also works)."
    )
    vocab_file: str = setting(
        "",
        "MindSpore's name for it, read like tokenizer_file: a tokenizer.json or its folder (convert a "
        "SentencePiece .model or vocab.json + merges.txt first).",
    )


@dataclass
class ProcessorConfig:
    tokenizer: TokenizerConfig = setting(
        TokenizerConfig,
        "The training data's tokenizer when train_dataset.data_loader.tokenizer is not set (special tokens "
        "come from the file itself).",
    )


@dataclass
class ParallelConfig:
    data_parallel: int = setting(1, "Data-parallel degree: model replicas, each reading different samples.", gt=0)
    model_parallel: int = setting(1, "Tensor-parallel degree: weight matrices split across this many devices.", gt=0)
    pipeline_stage: int = setting(1, "Pipeline-parallel degree: layers split into this many stages.", gt=0)
    micro_batch_num: int = setting(
        1, "Micro-batches per step under pipeline parallelism (4-8x pipeline_stage is typical).", gt=0
    )
    context_parallel: int = setting(1, "Context-parallel degree (reserved: only 1 is supported now).", ge=1)
    expert_parallel: int = setting(1, "Expert-parallel degree (reserved: only 1 is supported now).", ge=1)
    use_seq_parallel: bool = setting(
        False, "Sequence parallelism: shard norm/dropout activations along the sequence on the tensor-parallel group."
    )
    optimizer_shard: bool = setting(
        False, "Shard parameters, gradients and optimizer states over data parallel (FSDP)."
    )
    cpu_offload: bool = setting(
        False,
        "Keep the sharded parameters, gradients and optimizer states in host memory; the optimizer steps on the "
        "CPU (FSDP2 CPU offload; needs optimizer sharding).",
    )
    zero_stage: int | None = setting(
        None,
        "Optimizer sharding depth: 2 keeps parameters gathered from forward to backward, "
        "3 re-shards after forward (default: recompute_config.parallel_optimizer_comm_recompute).",
        choices=(None, 2, 3),
    )
    pipeline_schedule: str = setting(
        "1f1b",
        "Pipeline schedule.",
        choices=(
            "gpipe",
            "1f1b",
            "interleaved_1f1b",
            "looped_bfs",
            "interleaved_zero_bubble",
            "zbv_zero_bubble",
            "dualpipev",
        ),
    )
    pp_interleave_num: int = setting(
        1, "Virtual stages per pipeline rank (interleaved and zero-bubble schedules).", gt=0
    )
    gradient_aggregation_group: int = setting(
        4, "MindSpore gradient fusion group size (accepted, no effect: torch buckets itself).", gt=0
    )
    vocab_emb_dp: bool = setting(
        True, "MindSpore: keep the embedding data-parallel (accepted; tensor parallel shards it by vocab)."
    )


@dataclass
class OptimizerConfig:
    type: str = setting(
        "AdamW",
        "Optimizer: AdamW (FP32StateAdamWeightDecay and AdamWeightDecay are aliases).",
        choices=("AdamW", "FP32StateAdamWeightDecay", "AdamWeightDecay"),
    )
    learning_rate: float = setting(1e-4, "Peak learning rate (after warm-up).", gt=0)
    beta1: float = setting(0.9, "AdamW first-moment decay, in [0, 1).", ge=0, lt=1)
    beta2: float = setting(0.95, "AdamW second-moment decay, in [0, 1).", ge=0, lt=1)
    betas: list | None = setting(None, "[beta1, beta2] in one field, each in [0, 1) (overrides beta1/beta2).")
    eps: float = setting(1e-8, "AdamW epsilon.", gt=0)
    weight_decay: float = setting(0.1, "Decoupled weight decay (not applied to norms and biases).", ge=0)
    warmup_steps: int | None = setting(
        None, "Linear warm-up steps (overrides lr_schedule.warmup_steps/warmup_ratio).", ge=0
    )
    optimizer_parallel: int = setting(
        0, "Shard optimizer states over this many data-parallel ranks (0: off; FSDP/HSDP).", ge=0
    )
    foreach: bool = setting(True, "Use torch's multi-tensor AdamW kernels.")
    fused: bool | None = setting(
        None, "Use torch's fused AdamW kernel (one pass, no temporaries); default: wherever torch has it (GPUs, CPUs)."
    )


@dataclass
class LrScheduleConfig:
    type: str = setting(
        "CosineWithWarmUpLR",
        "Schedule after warm-up: cosine, linear or constant decay.",
        choices=("CosineWithWarmUpLR", "LinearWithWarmUpLR", "ConstantWarmUpLR", "cosine", "linear", "constant"),
    )
    learning_rate: float | None = setting(None, "Peak learning rate (default: optimizer.learning_rate).", gt=0)
    lr_end: float = setting(0.0, "Learning rate at the end of the decay.", ge=0)
    warmup_steps: int | None = setting(None, "Linear warm-up steps (default: warmup_ratio x total_steps).", ge=0)
    warmup_ratio: float = setting(0.0, "Warm-up as a fraction of total_steps when warmup_steps is not set.", ge=0, le=1)
    total_steps: int = setting(-1, "Schedule length in optimizer steps; -1: the run's length (stop_step or epochs).")


@dataclass
class RunnerConfig:
    epochs: int = setting(1, "Passes over the training split; used only when stop_step is 0.", gt=0)
    batch_size: int | None = setting(
        None, "Micro-batch size when train_dataset.batch_size is not given (MindSpore keeps both).", gt=0
    )
    gradient_accumulation_steps: int = setting(1, "Micro-batches accumulated per optimizer step on each rank.", gt=0)
    stop_step: int = setting(
        0, "End the run after this many optimizer steps (0: run all epochs).", ge=0, aliases=("train_steps",)
    )
    preemption_grace_seconds: float = setting(
        300.0,
        "After SIGTERM/SIGUSR1/SIGINT the run saves at the next step boundary and exits 0; past this many seconds "
        "it exits at once.",
        gt=0,
    )
    early_stopping_patience: int = setting(
        0,
        "Stop after this many evaluations without a better validation loss, keeping the best checkpoint (0: off).",
        ge=0,
    )
    sink_mode: bool = setting(True, "MindSpore graph sinking (accepted, no effect).")
    sink_size: int = setting(1, "MindSpore sink size (accepted, no effect).")


@dataclass
class RunnerWrapperConfig:
    type: str = setting(
        "MFTrainOneStepCell", "MindSpore step wrapper (accepted; meshformer always clips when use_clip_grad)."
    )
    use_clip_grad: bool = setting(True, "Clip the global gradient norm to max_grad_norm.")
    max_grad_norm: float = setting(1.0, "Gradient clipping threshold (global L2 norm).", gt=0)
    scale_sense: float | dict = setting(
        {}, "Loss scale: a number, or {type: DynamicLossScaleUpdateCell, ...} (fp16 default: dynamic from 65536)."
    )
    loss_spike_factor: float = setting(
        0.0,
        "Roll back when a step's loss exceeds this many times the mean of the last 20 (after warm-up): reload the "
        "newest checkpoint, skip the batches since; 0: off.",
        ge=0,
    )
    max_consecutive_skips: int = setting(
        3,
        "A step whose loss or gradient norm is not finite is skipped (no update); after this many in a row the "
        "run stops with exit code 1, keeping its checkpoints.",
        gt=0,
    )


@dataclass
class RecomputeConfig:
    recompute: bool | list = setting(
        False, "Activation recomputation: true for every layer, or a per-stage list of layer counts."
    )
    select_recompute: bool | list | dict = setting(
        False,
        "Selective recomputation (keep matmul/attention outputs, recompute element-wise work): true, per-stage "
        "layer counts, or MindSpore's {op pattern: counts}.",
    )
    parallel_optimizer_comm_recompute: bool = setting(
        False, "Recompute optimizer-shard all-gathers in backward (FSDP reshards)."
    )
    mp_comm_recompute: bool = setting(True, "Recompute tensor-parallel communication inside recomputed layers.")
    recompute_slice_activation: bool = setting(True, "Keep sliced (sequence-parallel) activations only (accepted).")


@dataclass
class SwapConfig:
    swap: bool = setting(
        False, "Move what decoder layers save for backward to pinned host memory in forward, back in backward (GPU)."
    )
    default_prefetch: int = setting(
        1, "Layers ahead that backward brings back from host memory (MindSpore counts operators here).", ge=1
    )
    layer_swap: list | None = setting(
        None, "Layers that swap: [{layers: true or [global layer indices], backward_prefetch: n}]; none: all."
    )
    op_swap: list | None = setting(None, "MindSpore's per-operator swap (refused: meshformer swaps whole layers).")


@dataclass
class CallbackConfig:
    type: str = setting(
        "MFLossMonitor",
        "MFLossMonitor (logging) or CheckpointMonitor (saving).",
        choices=("MFLossMonitor", "CheckpointMonitor", "ObsMonitor", "SummaryMonitor"),
    )
    per_print_times: int = setting(1, "MFLossMonitor: print a log line every this many steps.", gt=0)
    save_checkpoint_steps: int = setting(1000, "CheckpointMonitor: save every this many optimizer steps.", gt=0)
    keep_checkpoint_max: int = setting(
        5, "CheckpointMonitor: keep at most this many checkpoints (oldest deleted).", gt=0
    )
    prefix: str = setting("meshformer", "CheckpointMonitor: name prefix (accepted; directories are step_N).")
    integrated_save: bool = setting(
        False, "MindSpore merged save (accepted; checkpoints are sharded and loadable by any layout)."
    )
    async_save: bool = setting(
        False, "CheckpointMonitor: write checkpoints in the background (DCP async save) while training goes on."
    )
    checkpoint_format: str = setting("safetensors", "Checkpoint format (always safetensors).")


@dataclass
class EvalConfig:
    eval_interval: int = setting(
        0, "Evaluate on the validation split every this many steps (0: only when do_eval and at the end).", ge=0
    )
    eval_iters: int = setting(8, "Validation batches per evaluation.", gt=0)


@dataclass
class MonitorConfig:
    peak_flops: float = setting(0.0, "Peak FLOP/s of one device for MFU (0: measure a matmul once at start).", ge=0)
    progress_bar: str = setting(
        "auto",
        "Progress display: auto (rich bar on a terminal), rich, or plain log lines.",
        choices=("auto", "rich", "plain"),
    )
    journal: str = setting(
        "auto",
        "Tuning journal each run appends its config change and figures to (auto: journal.jsonl beside output_dir; "
        "empty: off).",
    )


@dataclass
class TensorboardConfig:
    tensorboard_dir: str = setting("", "Write every metric as TensorBoard scalars here (metrics rank; empty: off).")
    tensorboard_queue_size: int = setting(10, "Events buffered before TensorBoard's writer flushes.", gt=0)
    log_loss_scale_to_tensorboard: bool = setting(True, "MindSpore switch (accepted: every metric is written).")
    log_timers_to_tensorboard: bool = setting(True, "MindSpore switch (accepted: every metric is written).")


@dataclass
class ParallelContextConfig:
    parallel_mode: int = setting(1, "MindSpore parallel mode (accepted; meshformer always uses explicit parallelism).")
    enable_parallel_optimizer: bool = setting(
        False, "Shard optimizer states over data parallel (FSDP); see optimizer.optimizer_parallel."
    )
    gradients_mean: bool = setting(
        False, "MindSpore gradient mean (accepted; the loss is normalised by global tokens)."
    )
    full_batch: bool = setting(True, "MindSpore full-batch mode (accepted, no effect).")
    enable_alltoall: bool = setting(False, "MindSpore all-to-all (accepted, no effect).")
    search_mode: str = setting("sharding_propagation", "MindSpore auto-parallel search (accepted, no effect).")
    strategy_ckpt_save_file: str = setting("", "MindSpore strategy file (accepted, no effect: DCP records sharding).")
    parallel_optimizer_config: dict = setting({}, "MindSpore optimizer-shard options (accepted, no effect).")


@dataclass
class MeshformerConfig:
    run_mode: str = setting(
        "train",
        "What to do: train (pre-train), finetune, eval or predict.",
        choices=("train", "finetune", "eval", "predict"),
    )
    seed: int = setting(
        0, "Seed for initial weights and sample order; same seed, same run (0 to 2**32 - 1).", ge=0, le=2**32 - 1
    )
    output_dir: str = setting("./output", "Where checkpoints, metrics.jsonl and logs go.")
    resume_training: bool | str = setting(
        False,
        "Continue from the newest good checkpoint in output_dir (or load_checkpoint); auto: resume when one "
        "exists, fresh when there is none (restarts); never over checkpoints that all fail to verify.",
        choices=(False, True, "auto"),
    )
    load_checkpoint: str = setting("", "Checkpoint directory to start from (weights, and state when resuming).")
    overwrite_output_dir: bool = setting(
        False, "Allow a fresh run to replace meshformer's checkpoints and metrics in output_dir (other files stay)."
    )
    do_eval: bool = setting(False, "Evaluate on the validation split during training.")
    model: ModelSection = setting(ModelSection, "The network.")
    train_dataset: DatasetConfig = setting(DatasetConfig, "Training data.")
    eval_dataset: DatasetConfig = setting(
        DatasetConfig, "Validation data (default: the validation split of train_dataset's directory)."
    )
    processor: ProcessorConfig = setting(ProcessorConfig, "The tokenizer (MindSpore Transformers' processor block).")
    parallel_config: ParallelConfig = setting(ParallelConfig, "How the model is split across devices.")
    parallel: ParallelContextConfig = setting(
        ParallelContextConfig, "MindSpore parallel context (mostly accepted for compatibility)."
    )
    recompute_config: RecomputeConfig = setting(RecomputeConfig, "Activation recomputation.")
    swap_config: SwapConfig = setting(SwapConfig, "Activation swap to host memory (GPU runs).")
    compile: bool | str = setting(
        "auto",
        "torch.compile each decoder layer and the loss (Inductor); auto: on GPUs without tensor parallelism or swap, "
        "and on CPUs for runs of at least 100 TFLOP per process (compiling costs 25-60 s there).",
        choices=(True, False, "auto"),
    )
    cpu_matmul: str = setting(
        "auto",
        "fp32 linears on CPUs: onednn, blas (torch's MKL); auto: onednn on AVX-512 CPUs not made by Intel, where MKL "
        "runs AVX2 kernels, for calls of >= 4M multiply-adds (not with zero-bubble pipelines).",
        choices=("auto", "onednn", "blas"),
    )
    retain_host_memory: bool = setting(
        True,
        "CPU runs: keep the memory a step frees in the process (glibc malloc never trims, 256 MiB top pad) instead "
        "of page-faulting it back every step (-6% bf16 step time measured).",
    )
    optimizer: OptimizerConfig = setting(OptimizerConfig, "Optimizer and its hyper-parameters.")
    lr_schedule: LrScheduleConfig = setting(LrScheduleConfig, "Learning-rate schedule.")
    runner_config: RunnerConfig = setting(RunnerConfig, "Run length and accumulation.")
    runner_wrapper: RunnerWrapperConfig = setting(RunnerWrapperConfig, "Gradient clipping (MindSpore's step wrapper).")
    callbacks: list = setting(
        [{"type": "MFLossMonitor"}, {"type": "CheckpointMonitor"}],
        "Logging and checkpointing callbacks (list of {type: ...}).",
    )
    eval_config: EvalConfig = setting(EvalConfig, "Evaluation cadence.")
    monitor_config: MonitorConfig = setting(MonitorConfig, "Metrics and progress display.")
    tensorboard: TensorboardConfig = setting(TensorboardConfig, "TensorBoard event files of the metrics.")
    profile: bool = setting(False, "Record a torch.profiler trace of steps profile_start_step..profile_stop_step.")
    profile_start_step: int = setting(1, "First profiled step (1-based).", ge=1)
    profile_stop_step: int = setting(10, "Last profiled step (inclusive).", ge=1)
    profile_memory: bool = setting(True, "With profile on a GPU: also dump the CUDA allocator's history.")
    comm_timeout: int = setting(600, "Seconds any collective may take before the run fails (HCCL_EXEC_TIMEOUT).", gt=0)
    layer_decay: float = setting(
        1.0, "Layer-wise learning-rate decay: layer i of L gets lr x layer_decay^(L-i) (1.0: off).", gt=0, le=1
    )
    use_parallel: bool = setting(False, "MindSpore switch (accepted; the world size decides).")
    micro_batch_interleave_num: int = setting(1, "MindSpore micro-batch interleave (accepted, no effect).")


# Sub-schemas that appear inside lists.
LIST_ITEM_SCHEMAS = {("callbacks",): CallbackConfig}


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "__dataclass_fields__")


def field_default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()
