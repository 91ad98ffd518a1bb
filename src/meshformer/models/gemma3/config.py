"""Gemma 3's model config (the text model, Hugging Face `gemma3_text`): the common fields plus the layer pattern of
sliding and global attention, each kind's rotary base, and the attention's own score scale."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import setting
from meshformer.config.model_schema import ModelConfig, type_field
from meshformer.errors import UserError

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' names of the two layer types


@dataclass
class Gemma3Config(ModelConfig):
    """Gemma 3 (1B and the text towers of 4B/12B/27B): sliding-window layers with a local rotary base, every
    `sliding_window_pattern`-th layer global with its own; (1 + weight) RMSNorms before and after attention and
    feed-forward, q/k norms, GeGLU with tanh GELU, embeddings scaled by sqrt(hidden_size)."""

    type: str = type_field("Gemma3Config")
    theta: float = setting(
        1_000_000.0, "Rotary base of the global layers (Gemma 3: 1e6).", gt=0, aliases=("rotary_emb_base",)
    )
    tie_word_embeddings: bool = setting(True, "Share the input embedding matrix with the output projection.")
    sliding_window: int | None = setting(
        4096, "Keys a sliding layer's query attends, itself included (None: those layers are global too).", gt=0
    )
    sliding_window_pattern: int = setting(
        6, "Every N-th layer is global, the others sliding (Gemma 3: 6); layer_types overrides it.", gt=0
    )
    layer_types: list | None = setting(
        None, "Each layer's attention, sliding_attention or full_attention (None: from sliding_window_pattern)."
    )
    rope_local_base_freq: float = setting(10_000.0, "Rotary base of the sliding layers (Gemma 3: 1e4).", gt=0)
    global_rope_scaling_factor: float = setting(
        1.0, "Linear rotary scaling of the global layers' positions (Gemma 3 4B and up: 8; 1: none).", gt=0
    )
    query_pre_attn_scalar: float = setting(
        256.0, "Attention scores are q.k x query_pre_attn_scalar ** -0.5 (Gemma 3: the head width).", gt=0
    )

    # Llama's attention (models/llama/model.py) reads these: Gemma 3 has q/k norms and no q/k/v biases, always
    @property
    def qkv_has_bias(self) -> bool:
        return False

    @property
    def use_qk_norm(self) -> bool:
        return True

    def layer_kinds(self) -> list[str]:
        """Each layer's attention kind: `layer_types`, else transformers' rule of the pattern."""
        if self.layer_types is not None:
            return list(self.layer_types)
        n = self.sliding_window_pattern
        return [SLIDING if (i + 1) % n else FULL for i in range(self.num_layers)]

    def is_sliding(self, layer: int) -> bool:
        return self.layer_kinds()[layer] == SLIDING

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends globally)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def validate(self, cfg) -> None:
        where = "model.model_config"
        if self.layer_types is not None:
            bad = [t for t in self.layer_types if t not in (SLIDING, FULL)]
            if bad or len(self.layer_types) != self.num_layers:
                raise UserError(
                    f"{where}.layer_types={self.layer_types}: give num_layers={self.num_layers} entries, each "
                    f"{SLIDING} or {FULL} (or leave it unset for sliding_window_pattern)"
                )
        self.refuse_rope_scaling(
            "Gemma 3 scales only its global layers, linearly: set rope_scaling.type none and global_rope_scaling_factor"
        )
        super().validate(cfg)


CONFIG_CLASSES = {"Gemma3Config": Gemma3Config}
# The fields of this family's own a fine-tune takes from its base model
SHAPE_FIELDS = (
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
    "rope_local_base_freq",
    "global_rope_scaling_factor",
    "query_pre_attn_scalar",
)
