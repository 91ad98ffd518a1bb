"""Mistral's decoder: Llama's modules (models/llama/model.py) whose attention has the config's sliding window.

transformers' Mistral is LlamaAttention plus `sliding_window` (its modular_mistral.py): every layer's query sees its
`sliding_window` latest keys, itself included (models/attention.py `window_band`). The window is set on each
attention module at build, so training (SDPA with the banded mask, or the compiled CPU kernel that skips keys left
of it), packed rows, context parallelism (which bands the global positions) and generation (whose KV cache keeps a
ring of `window` keys per layer: models/kv_cache.py) all apply it with no code of their own here.
"""

from __future__ import annotations

from torch import nn

from meshformer.config.schema import ModelConfig
from meshformer.models.llama.model import DecoderLayer, Transformer


class MistralDecoderLayer(DecoderLayer):
    def make_attention(self, mc: ModelConfig) -> nn.Module:
        attention = super().make_attention(mc)
        attention.window = mc.sliding_window
        return attention


class MistralTransformer(Transformer):
    decoder_layer = MistralDecoderLayer
