"""Weights a run starts from (`load_checkpoint`): a checkpoint, a run directory or a model from outside that a
source the caller handed in claims (a Hugging Face directory: train/base_source.py)."""

from __future__ import annotations

from pathlib import Path

from meshformer.checkpoint import store
from meshformer.config.schema import MeshformerConfig
from meshformer.data.tokenizer import tokenizer_hash
from meshformer.errors import UserError
from meshformer.models.lora import base_name, lora_wanted
from meshformer.train.base_source import BaseModelSource


def check_tokenizer(ckpt: Path, dataset_tokenizer_hash: str) -> None:
    """The checkpoint (or model directory) must have been trained with the dataset's tokenizer."""
    tok = ckpt / "tokenizer.json"
    if tok.is_file() and tokenizer_hash(tok) != dataset_tokenizer_hash:
        raise UserError(
            f"load_checkpoint={str(ckpt)!r} was trained with a different tokenizer than "
            f"train_dataset's: preprocess the data with the checkpoint's tokenizer.json"
        )


def load_base_weights(
    src: Path,
    source: BaseModelSource | None,
    cfg: MeshformerConfig,
    parts,
    expected_shapes: dict,
    dataset_tokenizer_hash: str,
    run_dir,
) -> str:
    """Load weights only (not optimizer state, not the step) into this rank's parts; returns where from. `source`:
    the model source that claims `src` (train/base_source.py), None for a meshformer checkpoint or run.

    A LoRA model takes them into its base layers (`base_name`); its adapters keep their fresh initialisation."""
    lora = lora_wanted(cfg)
    rename = base_name if lora else None
    expected = expected_shapes
    if lora:
        expected = {base_name(k): v for k, v in expected.items() if base_name(k) is not None}
    if source is not None:
        check_tokenizer(src, dataset_tokenizer_hash)
        tensors = source.weights(src, expected, "load_checkpoint")
        if lora:
            tensors = {k: tensors[base_name(k)] for k in expected_shapes if base_name(k) is not None}
        store.load_full_weights(parts, tensors)
        return f"{source.label} {src}"
    ckpt = run_dir.resolve(src)
    check_tokenizer(ckpt, dataset_tokenizer_hash)
    store.load_model_weights(ckpt, parts, expected, rename)
    return str(ckpt)
