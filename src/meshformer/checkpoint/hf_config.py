"""Hugging Face `config.json` <-> `model.model_config`, dispatched to the model family that owns the architecture
(models/registry.py; the Llama family's mapping is models/llama/hf.py)."""

from __future__ import annotations

from meshformer.config.schema import ModelConfig
from meshformer.errors import UserError


def model_config_from_hf(hf: dict, where: str = "config.json") -> dict:
    """The `model.model_config` fields (a dict for the config loader) of a Hugging Face config.json."""
    from meshformer.models.registry import family_for_hf

    if not isinstance(hf, dict):
        raise UserError(f"{where}: expected a JSON object")
    family, _ = family_for_hf(hf, where)
    return family.config_from_hf(hf, where)


def hf_config_from_model(mc: ModelConfig, dtype: str) -> dict:
    """A config.json that `transformers` reads back as the same model."""
    from meshformer.models.registry import family_of

    return family_of(mc).config_to_hf(mc, dtype)
