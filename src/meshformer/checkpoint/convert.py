"""`meshformer import` and `meshformer export`: Hugging Face directories and GGUF files <-> meshformer checkpoints.

An import writes one checkpoint directory (weights only, step 0) with a config.yaml whose `model_config` comes
from the source's config.json (or GGUF metadata), the source's tokenizer.json and tokenizer_config.json (special
tokens, chat template) and a manifest, so `load_checkpoint`, `generate`, `preprocess --tokenizer` and
`meshformer export` take it like any checkpoint. Every tensor is checked against the model the config describes
(names and shapes, both ways) before anything is written. Both commands write into `OUTPUT.tmp-*` and rename it
to OUTPUT at the end: an existing OUTPUT is never touched, a failure leaves nothing that looks complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from meshformer.checkpoint.hf_config import hf_config_from_model, model_config_from_hf
from meshformer.checkpoint.hf_dir import read_hf_dir, to_hf_names, to_meshformer_names, write_hf_dir
from meshformer.checkpoint.saver import save_checkpoint
from meshformer.checkpoint.source import SourceModel
from meshformer.checkpoint.store import resolve_checkpoint, shape_problems
from meshformer.config.load import from_dict, to_dict
from meshformer.config.schema import MeshformerConfig, ModelConfig
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_source(src: str | Path) -> SourceModel:
    p = Path(src)
    if p.is_file() and p.suffix == ".gguf":
        from meshformer.checkpoint.gguf_read import read_gguf

        return read_gguf(p)
    if p.is_dir():
        return read_hf_dir(p)
    raise UserError(f"{src}: not a Hugging Face model directory (with config.json) or a .gguf file")


def _fresh_output(output: str | Path) -> tuple[Path, Path]:
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {out} already exists and is not empty: choose a new directory")
    tmp = out.with_name(out.name + ".tmp-convert")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier conversion's leftover (a name only we create)
    return out, tmp


def _finish(tmp: Path, out: Path) -> Path:
    if out.exists():
        out.rmdir()  # empty (checked in _fresh_output)
    tmp.rename(out)
    return out


def source_to_model(source: SourceModel) -> tuple[MeshformerConfig, dict[str, torch.Tensor]]:
    """(a config whose model_config is the source's, the source's tensors under meshformer's names and dtype),
    refusing a source whose tensors are not exactly that model's."""
    where = f"{source.origin} (config)"
    notices: list[str] = []
    cfg = MeshformerConfig()
    fields = model_config_from_hf(source.config, where)
    cfg.model.model_config = from_dict(ModelConfig, fields, ("model", "model_config"), notices)
    mc = cfg.model.model_config
    from meshformer.models import build_model

    expected = {k: tuple(v.shape) for k, v in build_model(mc).state_dict().items()}  # meta tensors: no memory
    tensors = to_meshformer_names(source.tensors, mc.tie_word_embeddings)
    problems = shape_problems({k: tuple(v.shape) for k, v in tensors.items()}, expected)
    if problems:
        raise UserError(
            f"{source.origin}: the weights do not match its config ({'; '.join(problems)}): the model directory "
            f"is damaged or its config.json belongs to another model"
        )
    dtype = DTYPE[mc.param_init_type]
    return cfg, {k: t.to(dtype) for k, t in tensors.items()}


def hf_weights_for(src: Path, expected: dict[str, tuple[int, ...]], field: str) -> dict[str, torch.Tensor]:
    """A Hugging Face directory's weights for the model `expected` describes ({name: shape}), or a one-line error
    saying how the two differ (`load_checkpoint:` straight from a Hugging Face directory)."""
    _, tensors = source_to_model(read_hf_dir(src))
    problems = shape_problems({k: tuple(v.shape) for k, v in tensors.items()}, expected)
    if problems:
        raise UserError(
            f"{field}={str(src)!r} is another model than model.model_config describes ({'; '.join(problems)}): "
            f"copy its settings (`meshformer import {src} --output DIR` writes them to DIR/config.yaml)"
        )
    return tensors


def import_model(src: str | Path, output: str | Path) -> tuple[Path, MeshformerConfig]:
    return write_import(read_source(src), output)


def write_import(source: SourceModel, output: str | Path) -> tuple[Path, MeshformerConfig]:
    if source.tokenizer_json is None:
        raise UserError(
            f"{source.origin}: no tokenizer.json: meshformer needs the model's tokenizer to train or generate"
        )
    cfg, tensors = source_to_model(source)
    out, tmp = _fresh_output(output)
    from meshformer.models import build_model

    model = build_model(cfg.model.model_config)
    model.load_state_dict(tensors, strict=True, assign=True)  # the tensors themselves: no second copy
    files = {
        "config.yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False).encode(),
        "tokenizer.json": source.tokenizer_json.encode(),
        "tokenizer_config.json": json.dumps(source.tokenizer_config, indent=1).encode(),
    }
    state = {"step": 0, "imported_from": source.origin, "finite": True}
    try:
        save_checkpoint(tmp, [model], None, state, files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _finish(tmp, out), cfg


def _tokenizer_config(ckpt: Path, tokenizer) -> dict:
    """The checkpoint's tokenizer_config.json with the chat template its training data was rendered with, or one
    made for meshformer's own tokenizers."""
    config = _saved_tokenizer_config(ckpt, tokenizer)
    if (ckpt / "chat_template.jinja").is_file():  # what training saw is what serving must use
        config["chat_template"] = (ckpt / "chat_template.jinja").read_text(encoding="utf-8")
    return config


def _saved_tokenizer_config(ckpt: Path, tokenizer) -> dict:
    f = ckpt / "tokenizer_config.json"
    if f.is_file():
        saved = json.loads(f.read_text(encoding="utf-8"))
        if saved:
            return {"tokenizer_class": "PreTrainedTokenizerFast", **saved}
    from meshformer.data.tokenizer import _hf_config, special_token_ids

    if tokenizer.token_to_id("<|im_start|>") is not None and tokenizer.token_to_id("<|pad|>") is not None:
        return _hf_config()
    ids = special_token_ids(tokenizer)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.id_to_token(ids["bos"]),
        "eos_token": tokenizer.id_to_token(ids["eos"]),
        "clean_up_tokenization_spaces": False,
    }


def export_model(
    checkpoint: str | Path,
    output: str | Path,
    dtype: str = "float32",
    shard_bytes: int = 5 << 30,
    merge_lora: bool = False,
    gguf_type: str | None = None,
) -> tuple[Path, Path, str]:
    """Write the Hugging Face directory of a checkpoint (or a run's newest good one): the full model, or for a
    LoRA run its adapter in PEFT's format (the full model with the adapters merged in: `merge_lora`); with
    `gguf_type` (F32, F16, BF16, Q8_0) one GGUF file at `output` instead (adapters merged).
    Returns (output, checkpoint, "model" | "adapter" | "gguf")."""
    from meshformer.checkpoint.inference import load_for_inference
    from meshformer.models.lora import lora_wanted, merged_state_dict, peft_adapter

    ckpt = resolve_checkpoint(checkpoint)
    if gguf_type is not None:
        return _export_gguf(ckpt, Path(output), dtype, gguf_type), ckpt, "gguf"
    out, tmp = _fresh_output(output)
    model, cfg, tokenizer = load_for_inference(ckpt)
    hf_cfg, tok_json, tok_cfg = _hf_side(ckpt, model, cfg, tokenizer, dtype)
    adapter = lora_wanted(cfg) and not merge_lora
    tmp.mkdir(parents=True)
    try:
        if adapter:
            adapter_config, tensors = peft_adapter(model, cfg, base=str(cfg.load_checkpoint or ""))
            save_file({k: v.to(DTYPE[dtype]).contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS))
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
            write_hf_dir(tmp, hf_cfg, {}, tok_json, tok_cfg, shard_bytes=shard_bytes, weights=False)
        else:
            state = merged_state_dict(model) if lora_wanted(cfg) else model.state_dict()
            tensors = {k: v.to(DTYPE[dtype]) for k, v in to_hf_names(state).items()}
            write_hf_dir(tmp, hf_cfg, tensors, tok_json, tok_cfg, shard_bytes=shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _finish(tmp, out), ckpt, "adapter" if adapter else "model"


def _hf_side(ckpt: Path, model, cfg, tokenizer, dtype: str) -> tuple[dict, str, dict]:
    """(config.json, tokenizer.json text, tokenizer_config) of a checkpoint as export writes them."""
    from meshformer.data.tokenizer import special_token_ids

    hf_cfg = hf_config_from_model(cfg.model.model_config, dtype)
    ids = special_token_ids(tokenizer, ckpt)
    for key, kind in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        if hf_cfg[key] is None:
            hf_cfg[key] = ids[kind]
    tok_json = (ckpt / "tokenizer.json").read_text(encoding="utf-8")  # the file as trained with, byte for byte
    return hf_cfg, tok_json, _tokenizer_config(ckpt, tokenizer)


def _export_gguf(ckpt: Path, out: Path, dtype: str, gguf_type: str) -> Path:
    from meshformer.checkpoint.gguf_write import write_gguf
    from meshformer.checkpoint.inference import load_for_inference
    from meshformer.models.lora import lora_wanted, merged_state_dict

    if out.suffix != ".gguf" or out.exists():
        raise UserError(f"--output {out}: give a new file name ending in .gguf for --format gguf")
    model, cfg, tokenizer = load_for_inference(ckpt)
    hf_cfg, tok_json, tok_cfg = _hf_side(ckpt, model, cfg, tokenizer, dtype)
    state = merged_state_dict(model) if lora_wanted(cfg) else model.state_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(out, hf_cfg, to_hf_names(state), tok_json, tok_cfg, qtype=gguf_type)
