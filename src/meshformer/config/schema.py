"""The whole configuration schema, in one place.

Field names follow MindSpore Transformers so
that users can bring their YAML files. Every field carries a one-line doc (`meta["doc"]`) that is also the
CLI help (`meshformer config explain`). Validation of single values (type, range, choices) is driven by the
metadata here; cross-field rules live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.data_schema import DatasetConfig, ProcessorConfig
from meshformer.config.distill_schema import DistillConfig
from meshformer.config.fields import field_default, is_dataclass_type, provenance, setting
from meshformer.config.fp8_schema import Fp8Config
from meshformer.config.model_schema import ModelConfig, ModelSection
from meshformer.config.preference_schema import PreferenceConfig
from meshformer.config.tracker_schema import REPORT_TO_DOC, RUN_NAME_DOC, TrackerConfig

__all__ = [
    "MeshformerConfig",
    "ModelConfig",
    "DatasetConfig",
    "LIST_ITEM_SCHEMAS",
    "field_default",
    "is_dataclass_type",
]


PIPELINE_SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)


@dataclass
class ParallelConfig:
    data_parallel: int = setting(1, "Data-parallel degree: model replicas, each reading different samples.", gt=0)
    model_parallel: int = setting(1, "Tensor-parallel degree: weight matrices split across this many devices.", gt=0)
    pipeline_stage: int = setting(1, "Pipeline-parallel degree: layers split into this many stages.", gt=0)
    micro_batch_num: int = setting(
        1, "Micro-batches per step under pipeline parallelism (4-8x pipeline_stage is typical).", gt=0
    )
    context_parallel: int = setting(
        1, "Context-parallel degree: every row's sequence split over this many ranks (2 chunks each).", ge=1
    )
    context_parallel_algo: str = setting(
        "colossalai_cp",
        "Context-parallel attention (MindSpore names): colossalai_cp all-gathers keys and values (ulysses_cp and "
        "hybrid_cp are refused: not built yet).",
        choices=("colossalai_cp", "ulysses_cp", "hybrid_cp"),
    )
    expert_parallel: int = setting(
        1,
        "Expert-parallel degree: MoE experts split over this many data/context-parallel ranks.",
        ge=1,
    )
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
        choices=PIPELINE_SCHEDULES,
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
    select_recompute_policy: str = setting(
        "matmuls",
        "What selective recompute keeps: matmuls (every matmul output) or alternate_matmuls (torchtitan's op-level "
        "AC: every other linear's output).",
        choices=("matmuls", "alternate_matmuls"),
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
    tasks: list = setting(
        [],
        "lm-eval tasks run at each evaluation, logged as eval/<task>/<metric> (pip install 'meshformer[eval]'); "
        "data-parallel and FSDP runs only.",
    )
    include_path: str = setting("", "A folder of task YAMLs of your own for tasks, beside lm-eval's.")
    num_fewshot: int | None = setting(None, "Few-shot examples per prompt for tasks (default: each task's own).", ge=0)
    limit: float | None = setting(
        None, "Documents per task at each evaluation (a fraction when below 1; default: all).", gt=0
    )
    batch_size: int = setting(1, "Requests per forward pass when running tasks.", gt=0)


@dataclass
class MonitorConfig:
    peak_flops: float = setting(
        0.0, "Peak FLOP/s of one device for MFU (0: a known device's data sheet, else the best timed matmul).", ge=0
    )
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
    fp8_config: Fp8Config = setting(Fp8Config, "FP8 training of the decoder's linears (torchao float8).")
    compile: bool | str = setting(
        "auto",
        "torch.compile each decoder layer and the loss (the loss stays eager under tensor parallelism); auto: GPUs "
        "without tensor parallelism or swap, CPU runs of at least 100 TFLOP per process.",
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
        "of page-faulting it back every step (shorter steps: docs/benchmarks.md).",
    )
    optimizer: OptimizerConfig = setting(OptimizerConfig, "Optimizer and its hyper-parameters.")
    lr_schedule: LrScheduleConfig = setting(LrScheduleConfig, "Learning-rate schedule.")
    runner_config: RunnerConfig = setting(RunnerConfig, "Run length and accumulation.")
    runner_wrapper: RunnerWrapperConfig = setting(RunnerWrapperConfig, "Gradient clipping (MindSpore's step wrapper).")
    preference_config: PreferenceConfig = setting(
        PreferenceConfig, "Preference post-training (DPO, KTO, ORPO, SimPO) on preprocessed preference data."
    )
    distill_config: DistillConfig = setting(
        DistillConfig, "Logit distillation from a frozen teacher of the same vocabulary (TRL's divergences)."
    )
    callbacks: list = setting(
        [{"type": "MFLossMonitor"}, {"type": "CheckpointMonitor"}],
        "Logging and checkpointing callbacks (list of {type: ...}).",
    )
    eval_config: EvalConfig = setting(EvalConfig, "Evaluation cadence.")
    monitor_config: MonitorConfig = setting(MonitorConfig, "Metrics and progress display.")
    tensorboard: TensorboardConfig = setting(TensorboardConfig, "TensorBoard event files of the metrics.")
    report_to: str | list = setting(["tensorboard"], REPORT_TO_DOC)
    run_name: str = setting("", RUN_NAME_DOC)
    tracker_config: TrackerConfig = setting(TrackerConfig, "Experiment trackers' project and local files.")
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
    # The model_config fields the file or the command line set (run_mode finetune takes the others from its base)
    model_fields_given: frozenset = provenance(frozenset(), "model_config fields the config set (load_config)")


# Sub-schemas that appear inside lists.
LIST_ITEM_SCHEMAS = {("callbacks",): CallbackConfig}
