"""Checkpoints: sharded DCP saves in safetensors form (`store.py`) and loading for inference (`inference.py`)."""

from meshformer.checkpoint.inference import load_for_inference
from meshformer.checkpoint.store import list_checkpoints, resolve_checkpoint

__all__ = ["load_for_inference", "list_checkpoints", "resolve_checkpoint"]
