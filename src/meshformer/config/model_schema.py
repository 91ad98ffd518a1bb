"""The `model` section: the architecture and numerics of the network (`model.model_config`, `model.arch`).

`ModelConfig` is the base every family's config class extends: the fields every decoder has (sizes, vocabulary,
dtypes, initialisation, rotary base, positions, tying, fine-tuning, the pipeline offset). A family's own fields
(latent attention, q/k/v biases, experts, ...) live in its folder (`models/<family>/config.py`), and
`model_config.type` picks the class through `MODEL_CONFIGS`, which the families fill as they register."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import DTYPES, MODEL_CONFIGS, setting
from meshformer.errors import UserError


def type_field(name: str):
    """The `type` field of a family's concrete config class: defaults to that class's own type name."""
    return setting(name, "Architecture: picks the family and its config class.", choices=MODEL_CONFIGS)


@dataclass
class RopeScalingConfig:
    type: str = setting(
        "none", "Rotary scaling: none, or llama3 (Llama 3.1 frequency-dependent scaling).", choices=("none", "llama3")
    )
    factor: float = setting(8.0, "Scaling: overall context extension factor.", gt=0)
    low_freq_factor: float = setting(1.0, "llama3 scaling: low-frequency wavelength factor.", gt=0)
    high_freq_factor: float = setting(4.0, "llama3 scaling: high-frequency wavelength factor.", gt=0)
    original_max_position_embeddings: int = setting(8192, "Scaling: context length of the unscaled model.", gt=0)


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
    quantize_base: str = setting(
        "none",
        "Store the frozen base linears of a LoRA model in 4-bit: nf4 (QLoRA's NormalFloat, blocks of 64 weights, "
        "double-quantized scales; needs torchao: pip install meshformer[lowp]).",
        choices=("none", "nf4"),
    )
    freeze_include: list = setting([], "Freeze parameters whose names match these globs, e.g. ['embed_tokens.*'].")
    freeze_exclude: list = setting([], "...except those matching these globs (they stay trainable).")


@dataclass
class ModelConfig:
    type: str = setting(
        "LlamaConfig",
        "Architecture: picks the family and its config class; the family's own fields are listed under its types.",
        choices=MODEL_CONFIGS,
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
        "none",
        "Short form of pet_config: lora sets pet_type lora; qlora also sets quantize_base nf4.",
        choices=("none", "lora", "qlora"),
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

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (a family built on models/moe/ says when; the base has none)."""
        return False

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` has a Mixture-of-Experts block instead of a dense MLP (never, for the base)."""
        return False

    @property
    def moe_layer_count(self) -> int:
        """How many layers have routed experts (none, for the base)."""
        return 0

    def window_of(self, layer: int) -> int | None:
        """The keys each query of layer `layer` attends, itself included (a sliding window); None: every key before
        it. The base's layers are global; a family with windows says which (FLOPs and the KV cache follow)."""
        return None

    @property
    def heads_are_dim_per_head(self) -> bool:
        """Every attention head is dim_per_head wide (grouped-query attention); a family whose heads have widths of
        their own fields (latent attention) says False and checks those widths itself."""
        return True

    def validate(self, cfg) -> None:
        """The family's own cross-field rules (one UserError line each); `cfg` is the whole MeshformerConfig. The
        base checks nothing: config/validate.py checks what every decoder shares."""

    def refuse_rope_scaling(self, why: str) -> None:
        """For a family whose rotary takes no `rope_scaling` (its `validate`): one line naming the field, then `why`
        and the fix."""
        if self.rope_scaling.type != "none":
            raise UserError(f"model.model_config.rope_scaling.type={self.rope_scaling.type}: {why}")


@dataclass
class ModelArchConfig:
    type: str = setting(
        "LlamaForCausalLM", "Model class (LlamaForCausalLM is the only causal LM head).", choices=("LlamaForCausalLM",)
    )


@dataclass
class ModelSection:
    model_config: ModelConfig = setting(ModelConfig, "Architecture and numerics of the network.")
    arch: ModelArchConfig = setting(ModelArchConfig, "Model head class.")
