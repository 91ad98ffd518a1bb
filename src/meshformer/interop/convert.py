"""`meshformer import` and `meshformer export`: Hugging Face directories, GGUF files and MindSpore checkpoints <->
meshformer checkpoints.

An import writes one checkpoint directory (weights only, step 0) with a config.yaml whose `model_config` comes
from the source's config.json (or GGUF metadata, or for a MindSpore checkpoint the MindSpore Transformers YAML given
with it: interop/mindspore_model.py), the source's tokenizer.json and tokenizer_config.json (special tokens, chat
template) and a manifest, so `load_checkpoint`, `generate`, `preprocess --tokenizer` and
`meshformer export` take it like any checkpoint. Every tensor is checked against the model the config describes
(names and shapes, both ways) before anything is written. Both commands write into `OUTPUT.tmp-*` and rename it
to OUTPUT at the end: an existing OUTPUT is never touched, a failure leaves nothing that looks complete.

An import from a Hugging Face directory records what PEFT should name as the base (BASE_KEY in
trainer_state.json: the hub id of a hub-cache snapshot, else the directory's absolute path); fine-tuning carries
it into the run's checkpoints, and an exported adapter's `base_model_name_or_path` is that record (or `--base`),
so `peft.AutoPeftModelForCausalLM.from_pretrained(adapter)` loads it as is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
import yaml

from meshformer.checkpoint.manifest import MANIFEST
from meshformer.checkpoint.safetensors_file import save_safetensors
from meshformer.checkpoint.saver import save_checkpoint
from meshformer.checkpoint.store import BASE_KEY, recorded_base, resolve_checkpoint, shape_problems
from meshformer.config.load import from_dict, to_dict
from meshformer.config.schema import MeshformerConfig, ModelConfig
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.interop.hf_config import check_import_sizes, hf_config_from_model, model_config_from_hf
from meshformer.interop.hf_dir import read_hf_dir, to_hf_names, to_meshformer_names, write_hf_dir
from meshformer.interop.source import SourceModel

ADAPTER_WEIGHTS = "adapter_model.safetensors"
# huggingface_hub's cache layout: .../models--{org}--{name}/snapshots/{revision}
_HUB_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[^/]+")


def hf_base_name(src: str | Path) -> str:
    """What a PEFT adapter should name as its base for a Hugging Face directory: the hub id of a hub-cache snapshot
    (portable, and the cache resolves it), else the absolute path (a relative one would depend on the cwd)."""
    path = os.path.abspath(src)
    m = _HUB_SNAPSHOT.search(Path(path).as_posix())
    return f"{m['org']}/{m['name']}" if m and m.end() == len(Path(path).as_posix()) else path


def read_source(src: str | Path) -> SourceModel:
    p = Path(src)
    if p.is_file() and p.suffix == ".gguf":
        from meshformer.interop.gguf_read import read_gguf

        return read_gguf(p)
    if p.is_dir():
        return read_hf_dir(p)
    raise UserError(f"{src}: not a Hugging Face model directory (with config.json) or a .gguf file")


def check_output_place(out: Path) -> None:
    """Before anything is loaded: an --output must go into a writable directory (not under a file, which would
    end in a traceback after the model is read), and never inside a checkpoint (an added directory there is
    nothing its manifest vouches for)."""
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"--output {out}: {parent} is a file, not a directory: choose another --output")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"--output {out}: {parent} is not writable: choose another --output")
            break
    marks = (MANIFEST, "trainer_state.json")  # a damaged checkpoint may have lost one
    inside = next((p for p in (out.resolve(), *out.resolve().parents) if any((p / m).is_file() for m in marks)), None)
    if inside is not None:
        raise UserError(f"--output {out} lies inside the checkpoint {inside}: write it outside the checkpoint")


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
    from meshformer.models import build_model, family_of

    tensors = to_meshformer_names(source.tensors, mc.tie_word_embeddings, family_of(mc))
    check_import_sizes(mc, source.config, tensors, where)  # a size typo: refused before a layer is built
    expected = {k: tuple(v.shape) for k, v in build_model(mc).state_dict().items()}  # meta tensors: no memory
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


def import_model(
    src: str | Path, output: str | Path, config: str | Path | None = None
) -> tuple[Path, MeshformerConfig]:
    """Import a Hugging Face directory, a GGUF file, or (with `config`, the MindSpore Transformers YAML it was
    trained with) a MindSpore checkpoint: a `.ckpt` / `.safetensors` file."""
    from meshformer.interop.hf_dir import is_hf_dir
    from meshformer.interop.mindspore_ckpt import is_mindspore_source

    p = Path(src)
    if is_mindspore_source(p) and not is_hf_dir(p):
        from meshformer.interop.mindspore_model import read_mindspore_model

        ms = read_mindspore_model(p, config)
        if ms.training_state:
            print(
                f"note: {len(ms.training_state)} training-state entries not imported (optimizer moments, step "
                f"counters: {', '.join(ms.training_state[:3])}, ...): the import is the model's weights",
                file=sys.stderr,
            )
        state = {"step": 0, "imported_from": ms.origin, "finite": True}
        return _write_model(ms.cfg, ms.tensors, ms.tokenizer_json, ms.tokenizer_config, state, output), ms.cfg
    if config is not None:
        raise UserError(
            f"--config {config}: only a MindSpore checkpoint (.ckpt or .safetensors file) takes a MindSpore "
            f"Transformers YAML; {src} carries its own config"
        )
    return write_import(read_source(src), output)


def write_import(source: SourceModel, output: str | Path) -> tuple[Path, MeshformerConfig]:
    if source.tokenizer_json is None:
        raise UserError(
            f"{source.origin}: no tokenizer.json: meshformer needs the model's tokenizer to train or generate"
        )
    cfg, tensors = source_to_model(source)
    state = {"step": 0, "imported_from": source.origin, "finite": True}
    if Path(source.origin).is_dir():  # a GGUF file is no base PEFT can load
        state[BASE_KEY] = hf_base_name(source.origin)
    return _write_model(cfg, tensors, source.tokenizer_json, source.tokenizer_config, state, output), cfg


def _write_model(
    cfg: MeshformerConfig, tensors: dict, tokenizer_json: str, tokenizer_config: dict, state: dict, output
) -> Path:
    """The imported checkpoint: weights (checked to be exactly the config's model), config.yaml, tokenizer files."""
    out, tmp = _fresh_output(output)
    from meshformer.models import build_model

    model = build_model(cfg.model.model_config)
    model.load_state_dict(tensors, strict=True, assign=True)  # the tensors themselves: no second copy
    files = {
        "config.yaml": yaml.safe_dump(to_dict(cfg), sort_keys=False).encode(),
        "tokenizer.json": tokenizer_json.encode(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=1).encode(),
    }
    try:
        save_checkpoint(tmp, [model], None, state, files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _finish(tmp, out)


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
    base: str | None = None,
    tokenizer_note: bool = True,
) -> tuple[Path, Path, str]:
    """Write the Hugging Face directory of a checkpoint (or a run's newest good one): the full model, or for a
    LoRA run its adapter in PEFT's format (the full model with the adapters merged in: `merge_lora`); with
    `gguf_type` (F32, F16, BF16, Q8_0) one GGUF file at `output` instead (adapters merged). An adapter names
    `base` (default: the base the checkpoint records) as its base_model_name_or_path; with neither it is null.
    A checkpoint without a tokenizer exports its weights alone, saying so (`tokenizer_note`) on stderr; GGUF,
    which holds its tokenizer, refuses it. Returns (output, checkpoint, "model" | "adapter" | "gguf")."""
    from meshformer.interop.inference import load_for_inference
    from meshformer.models import family_of
    from meshformer.models.lora import lora_wanted, merged_state_dict, peft_adapter

    ckpt = resolve_checkpoint(checkpoint)
    check_output_place(Path(output))
    if gguf_type is not None:
        return _export_gguf(ckpt, Path(output), dtype, gguf_type), ckpt, "gguf"
    out, tmp = _fresh_output(output)
    model, cfg, tokenizer = load_for_inference(ckpt, need_tokenizer=False)
    hf_cfg, tok_json, tok_cfg = _hf_side(ckpt, model, cfg, tokenizer, dtype)
    if tokenizer is None and tokenizer_note:
        print(f"note: {missing_tokenizer_note(ckpt, out)}", file=sys.stderr)
    adapter = lora_wanted(cfg) and not merge_lora
    tmp.mkdir(parents=True)
    try:
        if adapter:
            adapter_config, tensors = peft_adapter(model, cfg, base=base or recorded_base(ckpt))
            save_safetensors({k: v.to(DTYPE[dtype]).contiguous() for k, v in tensors.items()}, tmp / ADAPTER_WEIGHTS)
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
            write_hf_dir(tmp, hf_cfg, {}, tok_json, tok_cfg, shard_bytes=shard_bytes, weights=False)
        else:
            state = merged_state_dict(model) if lora_wanted(cfg) else model.state_dict()
            family = family_of(cfg.model.model_config)
            tensors = {k: v.to(DTYPE[dtype]) for k, v in to_hf_names(state, family, cfg.model.model_config).items()}
            write_hf_dir(tmp, hf_cfg, tensors, tok_json, tok_cfg, shard_bytes=shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _finish(tmp, out), ckpt, "adapter" if adapter else "model"


def missing_tokenizer_note(ckpt: Path, out: Path) -> str:
    """What export and merge say once when the checkpoint has no tokenizer to write beside the weights."""
    return (
        f"{ckpt} has no tokenizer.json (its run trained on data that carries none): {out} holds the weights and "
        f"config.json only; copy the tokenizer.json the data was made with into it"
    )


def _hf_side(ckpt: Path, model, cfg, tokenizer, dtype: str) -> tuple[dict, str | None, dict]:
    """(config.json, tokenizer.json text, tokenizer_config) of a checkpoint as export writes them (no tokenizer
    files for a checkpoint without one: its bos/eos ids then come from the model config alone)."""
    from meshformer.data.tokenizer import special_token_ids

    hf_cfg = hf_config_from_model(cfg.model.model_config, dtype)
    if tokenizer is None:
        return hf_cfg, None, {}
    ids = special_token_ids(tokenizer, ckpt)
    for key, kind in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        if hf_cfg[key] is None:
            hf_cfg[key] = ids[kind]
    tok_json = (ckpt / "tokenizer.json").read_text(encoding="utf-8")  # the file as trained with, byte for byte
    return hf_cfg, tok_json, _tokenizer_config(ckpt, tokenizer)


def _export_gguf(ckpt: Path, out: Path, dtype: str, gguf_type: str) -> Path:
    from meshformer.interop.gguf_write import write_gguf
    from meshformer.interop.inference import load_for_inference
    from meshformer.models import family_of
    from meshformer.models.lora import lora_wanted, merged_state_dict

    if out.suffix != ".gguf" or out.exists():
        raise UserError(f"--output {out}: give a new file name ending in .gguf for --format gguf")
    model, cfg, tokenizer = load_for_inference(ckpt)
    hf_cfg, tok_json, tok_cfg = _hf_side(ckpt, model, cfg, tokenizer, dtype)
    state = merged_state_dict(model) if lora_wanted(cfg) else model.state_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    family = family_of(cfg.model.model_config)
    return write_gguf(
        out, hf_cfg, to_hf_names(state, family, cfg.model.model_config), tok_json, tok_cfg, qtype=gguf_type
    )


def export_mindspore(checkpoint: str | Path, output: str | Path, dtype: str = "float32", fused: bool = False):
    """Write a checkpoint's model (LoRA adapters merged in) as one consolidated MindSpore `.ckpt` (or, named
    `.safetensors`, MindSpore's safetensors form) under MindSpore Transformers' names; with `fused` each layer's
    q/k/v and gate/up as its `qkv_concat: True` models hold them. Returns (output, checkpoint)."""
    from meshformer.interop.inference import load_for_inference
    from meshformer.interop.mindspore_ckpt import new_output, write_mindspore_checkpoint
    from meshformer.interop.mindspore_model import mindspore_tensors
    from meshformer.models.lora import lora_wanted, merged_state_dict

    ckpt = resolve_checkpoint(checkpoint)
    out = new_output(output)  # before loading anything
    check_output_place(out)
    model, cfg, _ = load_for_inference(ckpt, need_tokenizer=False)  # a MindSpore checkpoint holds no tokenizer
    state = merged_state_dict(model) if lora_wanted(cfg) else model.state_dict()
    tensors = mindspore_tensors(state, cfg.model.model_config, fused, DTYPE[dtype])
    return write_mindspore_checkpoint(out, tensors), ckpt
