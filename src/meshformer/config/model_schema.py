"""The `model` section: the architecture and numerics of the network (`model.model_config`, `model.arch`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import DTYPES, MODEL_TYPES, setting
from meshformer.config.moe_schema import MoeConfig


@dataclass
class RopeScalingConfig:
    type: str = setting(
        "none",
        "Rotary scaling: none, llama3 (Llama 3.1 frequency-dependent scaling) or yarn (DeepSeek-V2/V3).",
        choices=("none", "llama3", "yarn"),
    )
    factor: float = setting(8.0, "llama3 / yarn scaling: overall context extension factor.", gt=0)
    low_freq_factor: float = setting(1.0, "llama3 scaling: low-frequency wavelength factor.", gt=0)
    high_freq_factor: float = setting(4.0, "llama3 scaling: high-frequency wavelength factor.", gt=0)
    original_max_position_embeddings: int = setting(
        8192, "llama3 / yarn scaling: context length of the unscaled model.", gt=0
    )
    beta_fast: float = setting(32.0, "yarn scaling: rotations below which frequencies are interpolated fully.", gt=0)
    beta_slow: float = setting(1.0, "yarn scaling: rotations above which frequencies are kept.", gt=0)
    mscale: float = setting(
        1.0,
        "yarn scaling: cos/sin x mscale(factor, mscale) / mscale(factor, mscale_all_dim), as HF (0: not given).",
        ge=0,
    )
    mscale_all_dim: float = setting(
        0.0, "yarn scaling: softmax scale x (0.1 mscale_all_dim ln(factor) + 1)^2 (DeepSeek; 0: none).", ge=0
    )


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
    q_lora_rank: int | None = setting(
        None,
        "Latent attention: rank of the low-rank query projection (None: a full q_proj, as in V2-Lite).",
        gt=0,
    )
    kv_lora_rank: int | None = setting(
        None, "Latent attention (DeepSeek-V2/V3): rank of the compressed key/value; None: multi-head attention.", gt=0
    )
    qk_rope_head_dim: int = setting(64, "Latent attention: per-head width of the rotary part of queries/keys.", gt=0)
    qk_nope_head_dim: int = setting(128, "Latent attention: per-head width of the part without rotary.", gt=0)
    v_head_dim: int = setting(128, "Latent attention: per-head width of the values.", gt=0)
    rope_interleave: bool = setting(
        False, "Rotary on interleaved pairs (x0,x1),(x2,x3)... as DeepSeek's checkpoints are laid out."
    )
    moe_config: MoeConfig = setting(
        MoeConfig, "Mixture-of-Experts: experts, routing, balancing (MindSpore's top-level moe_config lands here)."
    )
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

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (moe_config.expert_num > 1)."""
        return self.moe_config.expert_num > 1

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` has a Mixture-of-Experts block instead of a dense MLP: DeepSeek's first_k_dense_replace
        and Qwen-MoE's decoder_sparse_step / mlp_only_layers together."""
        m = self.moe_config
        return (
            self.is_moe
            and index >= m.first_k_dense_replace
            and index not in m.mlp_only_layers
            and (index + 1) % m.decoder_sparse_step == 0
        )

    @property
    def moe_layer_count(self) -> int:
        """How many layers `is_moe_layer` calls sparse, counted without visiting them (a num_layers typo of a
        billion must not loop a billion times)."""
        if not self.is_moe:
            return 0
        m = self.moe_config
        first, step, n = m.first_k_dense_replace, m.decoder_sparse_step, self.num_layers
        if first >= n or step < 1:
            return 0
        listed = {i for i in m.mlp_only_layers if isinstance(i, int) and first <= i < n and (i + 1) % step == 0}
        return n // step - first // step - len(listed)  # (i + 1) a multiple of step, for i in [first, n)

    @property
    def expert_ffn_size(self) -> int:
        """Hidden width of one routed expert: moe_intermediate_size, else the dense MLP's."""
        return self.moe_config.moe_intermediate_size or self.ffn_hidden_size

    @property
    def shared_ffn_size(self) -> int:
        """Hidden width of the shared experts' MLP (0: none)."""
        m = self.moe_config
        if m.shared_expert_intermediate_size:
            return m.shared_expert_intermediate_size
        return m.shared_expert_num * self.expert_ffn_size

    @property
    def uses_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) instead of grouped-query attention."""
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys under latent attention (no-rope part + rotary part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class ModelArchConfig:
    type: str = setting(
        "LlamaForCausalLM", "Model class (LlamaForCausalLM is the only causal LM head).", choices=("LlamaForCausalLM",)
    )


@dataclass
class ModelSection:
    model_config: ModelConfig = setting(ModelConfig, "Architecture and numerics of the network.")
    arch: ModelArchConfig = setting(ModelArchConfig, "Model head class.")
