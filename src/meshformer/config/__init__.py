"""Configuration: one typed schema (`schema.py`), its loader (`load.py`) and cross-field rules (`validate.py`)."""

from meshformer.config.load import load_config, parse_overrides, to_dict
from meshformer.config.schema import MeshformerConfig, ModelConfig
from meshformer.config.validate import validate_layout

__all__ = ["MeshformerConfig", "ModelConfig", "load_config", "parse_overrides", "to_dict", "validate_layout"]
