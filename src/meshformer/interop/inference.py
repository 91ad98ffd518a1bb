"""Load a checkpoint into one process for generation or evaluation, whatever layout saved it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from meshformer.checkpoint.store import load_model_weights, resolve_checkpoint
from meshformer.errors import UserError


def load_for_inference(path: str | Path, device: str | torch.device = "cpu", need_tokenizer: bool = True):
    """-> (model in eval mode, MeshformerConfig, tokenizers.Tokenizer). `path`: a checkpoint or a run's output_dir.

    A run trained on data that carries no tokenizer (MindRecord, Megatron) without processor.tokenizer saved
    none: `need_tokenizer` (generate, eval) refuses such a checkpoint in one line, before the model is built;
    without it (export, merge: the weights alone are still worth having) the tokenizer is None."""
    from meshformer.backends.cpu import apply_cpu_matmul
    from meshformer.config.load import load_config
    from meshformer.data.tokenizer import load_tokenizer
    from meshformer.dtypes import DTYPE
    from meshformer.models import build_model, materialize
    from meshformer.models.sizes import check_weights_fit
    from meshformer.models.transforms import apply_model_transforms

    notes: list[str] = []
    ckpt = resolve_checkpoint(path, notes)  # a run directory: its newest checkpoint that verifies
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    if need_tokenizer and not (ckpt / "tokenizer.json").exists():
        raise UserError(no_tokenizer(ckpt))
    cfg_file = ckpt / "config.yaml"
    if not cfg_file.is_file():
        raise UserError(f"{ckpt}: config.yaml is missing: this checkpoint was not written by `meshformer train`")
    cfg = load_config(cfg_file)
    mc = cfg.model.model_config
    check_weights_fit(mc, device, f"{cfg_file}: model.model_config")  # a size typo: refused before it is built
    model = build_model(mc)
    apply_model_transforms(model, cfg)  # e.g. LoRA: the checkpoint holds base layers and adapters
    # The fp32 linears on oneDNN as in training (cpu_matmul; decoding steps stay under its size threshold).
    apply_cpu_matmul(model, cfg.cpu_matmul, torch.device(device), DTYPE[mc.compute_dtype])
    materialize(model, device, cfg.seed, DTYPE[mc.param_init_type])
    load_model_weights(ckpt, [model], {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model.eval()
    has_tokenizer = need_tokenizer or (ckpt / "tokenizer.json").exists()
    return model, cfg, load_tokenizer(ckpt / "tokenizer.json") if has_tokenizer else None


def no_tokenizer(ckpt: Path) -> str:
    """Why a checkpoint has no tokenizer, and the way (with existing commands) to give it one."""
    return (
        f"checkpoint {str(ckpt)!r} has no tokenizer.json (its run trained on data that carries none, without "
        f"processor.tokenizer.tokenizer_file): to add one, `meshformer export {ckpt} --output DIR`, copy the "
        f"tokenizer.json the data was made with into DIR, then `meshformer import DIR --output NEW` and use NEW"
    )
