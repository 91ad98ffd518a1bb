"""A model from outside meshformer, in Hugging Face terms: what every importer (HF directory, GGUF file) yields.

`config` is a `config.json` as Hugging Face writes it, `tensors` are named as in Hugging Face checkpoints
(`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...) in the rotary layout of `transformers`
(half-split q/k rows), and the tokenizer comes as the text of a `tokenizer.json` plus `tokenizer_config.json`
(special tokens, chat template). Converting that to meshformer is then a renaming (`checkpoint/hf.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SourceModel:
    config: dict
    tensors: dict[str, torch.Tensor]
    tokenizer_json: str | None = None
    tokenizer_config: dict = field(default_factory=dict)
    origin: str = ""  # where it came from, for messages and trainer_state.json
