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


def F(default: Any, doc: str, *, choices: tuple | None = None, ge: float | None = None,
      gt: float | None = None, le: float | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A schema field: default, one-line doc, and the value checks the loader applies."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    if isinstance(default, type) and hasattr(default, "__dataclass_fields__"):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RopeScalingConfig:
    type: str = F("none", "Rotary scaling: none, or llama3 (Llama 3.1 frequency-dependent scaling).",
                  choices=("none", "llama3"))
    factor: float = F(8.0, "llama3 scaling: overall context extension factor.", gt=0)
    low_freq_factor: float = F(1.0, "llama3 scaling: low-frequency wavelength factor.", gt=0)
    high_freq_factor: float = F(4.0, "llama3 scaling: high-frequency wavelength factor.", gt=0)
    original_max_position_embeddings: int = F(8192, "llama3 scaling: context length of the unscaled model.", gt=0)


@dataclass
class ModelConfig:
    type: str = F("LlamaConfig", "Architecture family: LlamaConfig, Qwen2Config (q/k/v bias) or Qwen3Config (q/k norm).",
                  choices=("LlamaConfig", "Qwen2Config", "Qwen3Config"))
    seq_length: int = F(2048, "Tokens per training sample (the context length trained on).", gt=0)
    hidden_size: int = F(4096, "Model width (embedding dimension).", gt=0)
    num_layers: int = F(32, "Number of decoder layers.", gt=0)
    num_heads: int = F(32, "Attention (query) heads; model_parallel must divide it.", gt=0)
    n_kv_heads: int | None = F(None, "Key/value heads for grouped-query attention (default: num_heads).", gt=0)
    head_dim: int | None = F(None, "Per-head width (default: hidden_size / num_heads).", gt=0)
    intermediate_size: int | None = F(None, "SwiGLU hidden width (default: Llama rule from multiple_of and ffn_dim_multiplier).", gt=0)
    multiple_of: int = F(256, "Round the default intermediate_size up to a multiple of this.", gt=0)
    ffn_dim_multiplier: float | None = F(None, "Scale the default intermediate_size by this factor.", gt=0)
    vocab_size: int = F(32000, "Vocabulary size; must be at least the tokenizer's vocabulary.", gt=0)
    rms_norm_eps: float = F(1e-5, "Epsilon of every RMSNorm.", gt=0)
    theta: float = F(10000.0, "Rotary embedding base frequency.", gt=0, aliases=("rotary_emb_base",))
    rope_scaling: RopeScalingConfig = F(RopeScalingConfig, "Optional rotary frequency scaling (llama3 style).")
    tie_word_embeddings: bool = F(False, "Share the input embedding matrix with the output projection.")
    qkv_has_bias: bool = F(False, "Add a bias to the q/k/v projections (Qwen2).")
    use_qk_norm: bool = F(False, "RMSNorm on each query and key head before rotary (Qwen3).")
    compute_dtype: str = F("float32", "Dtype of matmuls and activations (bfloat16 for mixed precision).", choices=DTYPES)
    layernorm_compute_dtype: str = F("float32", "Dtype RMSNorm computes in (keep float32 for stability).",
                                     choices=DTYPES, aliases=("layernorm_compute_type",))
    softmax_compute_dtype: str = F("float32", "Dtype of the loss's log-softmax (attention kernels accumulate softmax in fp32).",
                                   choices=DTYPES, aliases=("softmax_compute_type",))
    rotary_dtype: str = F("float32", "Dtype the rotary cos/sin tables are computed in.", choices=DTYPES)
    param_init_type: str = F("float32", "Dtype parameters are stored in (the master weights).", choices=DTYPES,
                             aliases=("params_dtype",))
    init_std: float = F(0.02, "Standard deviation of the normal weight initialisation.", gt=0)
    bos_token_id: int | None = F(None, "Beginning-of-sequence id (default: the tokenizer's).")
    eos_token_id: int | None = F(None, "End-of-sequence id (default: the tokenizer's).")
    pad_token_id: int | None = F(None, "Padding id (default: the tokenizer's).")
    ignore_token_id: int = F(-100, "Label value that the loss ignores.")
    pet_config: dict | None = F(None, "Parameter-efficient fine-tuning (pet_type: lora); not supported yet, rejected.")
    offset: int | list = F(0, "Pipeline layer split: 0 for even, or a list of per-stage layer-count adjustments.")


@dataclass
class ModelArchConfig:
    type: str = F("LlamaForCausalLM", "Model class (LlamaForCausalLM is the only causal LM head).",
                  choices=("LlamaForCausalLM",))


@dataclass
class ModelSection:
    model_config: ModelConfig = F(ModelConfig, "Architecture and numerics of the network.")
    arch: ModelArchConfig = F(ModelArchConfig, "Model head class.")


@dataclass
class DataLoaderConfig:
    type: str = F("MindDataset", "Dataset format: MindDataset means a `meshformer preprocess` directory.",
                  choices=("MindDataset",))
    dataset_dir: str = F("", "Directory written by `meshformer preprocess`.")
    shuffle: bool = F(True, "Shuffle sample order each epoch (the order is derived from seed, so resumable).")


@dataclass
class DatasetConfig:
    data_loader: DataLoaderConfig = F(DataLoaderConfig, "Where the tokens come from.")
    batch_size: int | None = F(None, "Micro-batch size: samples per forward pass on each data-parallel rank "
                                     "(default: runner_config.batch_size, else 1).", gt=0)
    drop_remainder: bool = F(True, "MindSpore batching flag (accepted; training always drops an epoch's incomplete "
                                   "last global batch, evaluation reads whole micro-batches).")
    split: str | None = F(None, "Split of the dataset directory to read (default: train for train_dataset, "
                                "validation for eval_dataset).", choices=("train", "validation"))


@dataclass
class ParallelConfig:
    data_parallel: int = F(1, "Data-parallel degree: model replicas, each reading different samples.", gt=0)
    model_parallel: int = F(1, "Tensor-parallel degree: weight matrices split across this many devices.", gt=0)
    pipeline_stage: int = F(1, "Pipeline-parallel degree: layers split into this many stages.", gt=0)
    micro_batch_num: int = F(1, "Micro-batches per step under pipeline parallelism (4-8x pipeline_stage is typical).", gt=0)
    context_parallel: int = F(1, "Context-parallel degree (reserved: only 1 is supported now).", ge=1, le=1)
    expert_parallel: int = F(1, "Expert-parallel degree (reserved: only 1 is supported now).", ge=1, le=1)
    use_seq_parallel: bool = F(False, "Sequence parallelism: shard norm/dropout activations along the sequence on the tensor-parallel group.")
    optimizer_shard: bool = F(False, "Shard parameters, gradients and optimizer states over data parallel (FSDP).")
    zero_stage: int | None = F(None, "Optimizer sharding depth: 2 keeps parameters gathered from forward to backward, "
                               "3 re-shards after forward (default: recompute_config.parallel_optimizer_comm_recompute).",
                               choices=(None, 2, 3))
    pipeline_schedule: str = F("1f1b", "Pipeline schedule.", choices=(
        "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"))
    pp_interleave_num: int = F(1, "Virtual stages per pipeline rank (interleaved and zero-bubble schedules).", gt=0)
    gradient_aggregation_group: int = F(4, "MindSpore gradient fusion group size (accepted, no effect: torch buckets itself).", gt=0)
    vocab_emb_dp: bool = F(True, "MindSpore: keep the embedding data-parallel (accepted; tensor parallel shards it by vocab).")


@dataclass
class OptimizerConfig:
    type: str = F("AdamW", "Optimizer: AdamW (FP32StateAdamWeightDecay and AdamWeightDecay are aliases).",
                  choices=("AdamW", "FP32StateAdamWeightDecay", "AdamWeightDecay"))
    learning_rate: float = F(1e-4, "Peak learning rate (after warm-up).", ge=0)
    beta1: float = F(0.9, "AdamW first-moment decay.", ge=0, le=1)
    beta2: float = F(0.95, "AdamW second-moment decay.", ge=0, le=1)
    betas: list | None = F(None, "[beta1, beta2] in one field (overrides beta1/beta2 when given).")
    eps: float = F(1e-8, "AdamW epsilon.", gt=0)
    weight_decay: float = F(0.1, "Decoupled weight decay (not applied to norms and biases).", ge=0)
    warmup_steps: int | None = F(None, "Linear warm-up steps (overrides lr_schedule.warmup_steps/warmup_ratio).", ge=0)
    optimizer_parallel: int = F(0, "Shard optimizer states over this many data-parallel ranks (0: off; FSDP/HSDP).", ge=0)
    foreach: bool = F(True, "Use torch's multi-tensor AdamW kernels.")


@dataclass
class LrScheduleConfig:
    type: str = F("CosineWithWarmUpLR", "Schedule after warm-up: cosine, linear or constant decay.", choices=(
        "CosineWithWarmUpLR", "LinearWithWarmUpLR", "ConstantWarmUpLR", "cosine", "linear", "constant"))
    learning_rate: float | None = F(None, "Peak learning rate (default: optimizer.learning_rate).", ge=0)
    lr_end: float = F(0.0, "Learning rate at the end of the decay.", ge=0)
    warmup_steps: int | None = F(None, "Linear warm-up steps (default: warmup_ratio x total_steps).", ge=0)
    warmup_ratio: float = F(0.0, "Warm-up as a fraction of total_steps when warmup_steps is not set.", ge=0, le=1)
    total_steps: int = F(-1, "Schedule length in optimizer steps; -1: the run's length (stop_step or epochs).")


@dataclass
class RunnerConfig:
    epochs: int = F(1, "Passes over the training split; used only when stop_step is 0.", gt=0)
    batch_size: int | None = F(None, "Micro-batch size when train_dataset.batch_size is not given (MindSpore keeps both).", gt=0)
    gradient_accumulation_steps: int = F(1, "Micro-batches accumulated per optimizer step on each rank.", gt=0)
    stop_step: int = F(0, "End the run after this many optimizer steps (0: run all epochs).", ge=0,
                       aliases=("train_steps",))
    sink_mode: bool = F(True, "MindSpore graph sinking (accepted, no effect).")
    sink_size: int = F(1, "MindSpore sink size (accepted, no effect).")


@dataclass
class RunnerWrapperConfig:
    type: str = F("MFTrainOneStepCell", "MindSpore step wrapper (accepted; meshformer always clips when use_clip_grad).")
    use_clip_grad: bool = F(True, "Clip the global gradient norm to max_grad_norm.")
    max_grad_norm: float = F(1.0, "Gradient clipping threshold (global L2 norm).", gt=0)
    scale_sense: float | dict = F({}, "MindSpore loss scaling: a fixed scale or a DynamicLossScaleUpdateCell (accepted; "
                                      "bf16 needs none).")


@dataclass
class RecomputeConfig:
    recompute: bool | list = F(False, "Activation recomputation: true for every layer, or a per-stage list of layer counts.")
    select_recompute: bool | dict = F(False, "Selective recomputation (accepted; meshformer recomputes whole layers).")
    parallel_optimizer_comm_recompute: bool = F(False, "Recompute optimizer-shard all-gathers in backward (FSDP reshards).")
    mp_comm_recompute: bool = F(True, "Recompute tensor-parallel communication inside recomputed layers.")
    recompute_slice_activation: bool = F(True, "Keep sliced (sequence-parallel) activations only (accepted).")


@dataclass
class CallbackConfig:
    type: str = F("MFLossMonitor", "MFLossMonitor (logging) or CheckpointMonitor (saving).",
                  choices=("MFLossMonitor", "CheckpointMonitor", "ObsMonitor", "SummaryMonitor"))
    per_print_times: int = F(1, "MFLossMonitor: print a log line every this many steps.", gt=0)
    save_checkpoint_steps: int = F(1000, "CheckpointMonitor: save every this many optimizer steps.", gt=0)
    keep_checkpoint_max: int = F(5, "CheckpointMonitor: keep at most this many checkpoints (oldest deleted).", gt=0)
    prefix: str = F("meshformer", "CheckpointMonitor: name prefix (accepted; directories are step_N).")
    integrated_save: bool = F(False, "MindSpore merged save (accepted; checkpoints are sharded and loadable by any layout).")
    async_save: bool = F(False, "MindSpore async save (accepted, saves are synchronous).")
    checkpoint_format: str = F("safetensors", "Checkpoint format (always safetensors).")


@dataclass
class EvalConfig:
    eval_interval: int = F(0, "Evaluate on the validation split every this many steps (0: only when do_eval and at the end).", ge=0)
    eval_iters: int = F(8, "Validation batches per evaluation.", gt=0)


@dataclass
class MonitorConfig:
    peak_flops: float = F(0.0, "Peak FLOP/s of one device for MFU (0: measure a matmul once at start).", ge=0)
    progress_bar: str = F("auto", "Progress display: auto (rich bar on a terminal), rich, or plain log lines.",
                          choices=("auto", "rich", "plain"))


@dataclass
class ParallelContextConfig:
    parallel_mode: int = F(1, "MindSpore parallel mode (accepted; meshformer always uses explicit parallelism).")
    enable_parallel_optimizer: bool = F(False, "Shard optimizer states over data parallel (FSDP); see optimizer.optimizer_parallel.")
    gradients_mean: bool = F(False, "MindSpore gradient mean (accepted; the loss is normalised by global tokens).")
    full_batch: bool = F(True, "MindSpore full-batch mode (accepted, no effect).")
    enable_alltoall: bool = F(False, "MindSpore all-to-all (accepted, no effect).")
    search_mode: str = F("sharding_propagation", "MindSpore auto-parallel search (accepted, no effect).")
    strategy_ckpt_save_file: str = F("", "MindSpore strategy file (accepted, no effect: DCP records sharding).")
    parallel_optimizer_config: dict = F({}, "MindSpore optimizer-shard options (accepted, no effect).")


@dataclass
class MeshformerConfig:
    run_mode: str = F("train", "What to do: train (pre-train), finetune, eval or predict.",
                      choices=("train", "finetune", "eval", "predict"))
    seed: int = F(0, "Seed for initial weights and sample order; same seed, same run.", ge=0)
    output_dir: str = F("./output", "Where checkpoints, metrics.jsonl and logs go.")
    resume_training: bool = F(False, "Continue from the newest checkpoint in output_dir (or load_checkpoint).")
    load_checkpoint: str = F("", "Checkpoint directory to start from (weights, and state when resuming).")
    overwrite_output_dir: bool = F(False, "Allow a fresh run to replace checkpoints and metrics already in output_dir.")
    do_eval: bool = F(False, "Evaluate on the validation split during training.")
    model: ModelSection = F(ModelSection, "The network.")
    train_dataset: DatasetConfig = F(DatasetConfig, "Training data.")
    eval_dataset: DatasetConfig = F(DatasetConfig, "Validation data (default: the validation split of train_dataset's directory).")
    parallel_config: ParallelConfig = F(ParallelConfig, "How the model is split across devices.")
    parallel: ParallelContextConfig = F(ParallelContextConfig, "MindSpore parallel context (mostly accepted for compatibility).")
    recompute_config: RecomputeConfig = F(RecomputeConfig, "Activation recomputation.")
    optimizer: OptimizerConfig = F(OptimizerConfig, "Optimizer and its hyper-parameters.")
    lr_schedule: LrScheduleConfig = F(LrScheduleConfig, "Learning-rate schedule.")
    runner_config: RunnerConfig = F(RunnerConfig, "Run length and accumulation.")
    runner_wrapper: RunnerWrapperConfig = F(RunnerWrapperConfig, "Gradient clipping (MindSpore's step wrapper).")
    callbacks: list = F([{"type": "MFLossMonitor"}, {"type": "CheckpointMonitor"}],
                        "Logging and checkpointing callbacks (list of {type: ...}).")
    eval_config: EvalConfig = F(EvalConfig, "Evaluation cadence.")
    monitor_config: MonitorConfig = F(MonitorConfig, "Metrics and progress display.")
    comm_timeout: int = F(600, "Seconds any collective may take before the run fails (HCCL_EXEC_TIMEOUT).", gt=0)
    layer_decay: float = F(1.0, "Layer-wise learning-rate decay: layer i of L gets lr x layer_decay^(L-i) (1.0: off).", gt=0, le=1)
    use_parallel: bool = F(False, "MindSpore switch (accepted; the world size decides).")
    micro_batch_interleave_num: int = F(1, "MindSpore micro-batch interleave (accepted, no effect).")


# Sub-schemas that appear inside lists.
LIST_ITEM_SCHEMAS = {("callbacks",): CallbackConfig}

# MindSpore-only keys users carry over from real configs: accepted and ignored, with one notice each.
IGNORED_KEYS = {
    (): {"context", "trainer", "processor", "metric", "eval_callbacks", "auto_tune", "filepath_prefix",
         "autotune_per_step", "profile", "profile_start_step", "profile_stop_step", "init_start_profile",
         "profile_communication", "profile_memory", "layer_scale", "lr_scale_factor", "remote_save_url",
         "src_strategy_path_or_dir", "auto_trans_ckpt", "only_save_strategy", "load_ckpt_format",
         "train_dataset_task", "eval_dataset_task", "moe_config", "use_legacy", "pretrained_model_dir"},
    ("parallel",): {"strategy_ckpt_config", "dataset_strategy"},
    ("train_dataset",): {"seed", "input_columns", "construct_args_key", "num_parallel_workers", "python_multiprocessing",
                         "repeat", "numa_enable", "prefetch_size", "output_columns"},
    ("eval_dataset",): {"seed", "input_columns", "construct_args_key", "num_parallel_workers", "python_multiprocessing",
                        "repeat", "numa_enable", "prefetch_size", "output_columns"},
    ("model", "model_config"): {"batch_size", "use_past", "use_flash_attention", "checkpoint_name_or_path",
                                "repetition_penalty", "max_decode_length", "top_k", "top_p", "do_sample",
                                "scaling_factor", "extend_method", "max_position_embedding", "emb_dropout_prob",
                                "use_past_shard", "fine_grain_interleave", "qkv_concat", "rotary_pct",
                                "is_dynamic", "block_size", "num_blocks", "input_sliced_sig", "router_dense_type"},
}


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "__dataclass_fields__")


def field_default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()
