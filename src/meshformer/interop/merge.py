"""`meshformer ckpt merge`: a checkpoint, whatever layout saved it, as one Hugging Face model directory."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from meshformer.checkpoint import store
from meshformer.checkpoint.contents import read_header
from meshformer.checkpoint.safetensors_file import save_safetensors
from meshformer.errors import UserError

MERGE_INFO = "merge_info.json"  # marks a directory `ckpt merge` wrote: the only kind --overwrite replaces
OPTIMIZER_FILE = "optimizer.safetensors"


def merge(ckpt: Path, output: Path, overwrite: bool = False, with_optimizer: bool = False) -> dict:
    """The checkpoint, whatever layout saved it, as one Hugging Face model directory of full tensors: what
    `export` writes (config.json, safetensors weights in the checkpoint's dtype and Hugging Face names, tokenizer
    files; a LoRA run's adapters merged in), so transformers, `load_checkpoint` and `run_mode: finetune` take it
    as it is; with `with_optimizer` also `optimizer.safetensors` (AdamW's tensors, `state.<weight name>.<stat>`).

    Built under a temporary name and renamed: an existing `output` is replaced only with `overwrite`, only when
    an earlier merge wrote it, and only once the new one is complete."""
    from meshformer.config.load import load_config
    from meshformer.interop.convert import check_output_place, export_model, missing_tokenizer_note

    if output.suffix == ".safetensors":
        raise UserError(
            f"--output={str(output)!r}: merge writes a Hugging Face model directory (config.json, "
            f"model.safetensors, tokenizer): name a directory, e.g. {str(output.with_suffix(''))!r}"
        )
    if output.exists() and not (overwrite and (output / MERGE_INFO).is_file()):
        hint = "pass --overwrite to replace it" if not overwrite else "--overwrite replaces only a merge's output"
        raise UserError(f"--output={str(output)!r} already exists: {hint}, or choose another path")
    check_output_place(output)
    dtype = load_config(ckpt / "config.yaml").model.model_config.param_init_type
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-merge-{os.getpid()}")
    old = output.with_name(f".{output.name}.old-merge-{os.getpid()}")
    # names only a merge of this pid creates: an earlier one's that was killed; other pids' may still be running
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        export_model(ckpt, tmp, dtype=dtype, merge_lora=True, tokenizer_note=False)
        if not (tmp / "tokenizer.json").exists():
            print(f"note: {missing_tokenizer_note(ckpt, output)}", file=sys.stderr)
        n_optim = _write_optimizer(ckpt, tmp / OPTIMIZER_FILE) if with_optimizer else 0
        state = json.loads((ckpt / "trainer_state.json").read_text())
        info = {"source": str(ckpt), "step": state.get("step"), "dtype": dtype, "optimizer_tensors": n_optim}
        (tmp / MERGE_INFO).write_text(json.dumps(info, indent=1))
        if output.exists():
            output.rename(old)
        tmp.rename(output)
    except BaseException:
        if old.exists() and not output.exists():
            old.rename(output)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)  # the earlier merge, once the new one is in place
    weights = sorted(output.glob("model*.safetensors"))
    n = sum(len(read_header(f)[0]) for f in weights)
    return {
        "tensors": n,
        "optimizer_tensors": n_optim,
        "output": str(output),
        "dtype": dtype,
        "bytes": sum(f.stat().st_size for f in output.iterdir()),
    }


def _write_optimizer(ckpt: Path, where: Path) -> int:
    """The checkpoint's optimizer tensors, full, renamed to the weights' Hugging Face names."""
    from meshformer.config.load import load_config
    from meshformer.interop.hf_dir import to_hf_names
    from meshformer.models import family_of

    if not (ckpt / "optim").is_dir():
        raise UserError(f"checkpoint {str(ckpt)!r} holds no optimizer state (an import?): drop --optimizer")
    meta = store.tensor_metadata(ckpt / "optim")
    target = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in meta.items()}
    store.dcp_call(dcp.load, target, storage_reader=dcp.HuggingFaceStorageReader(str(ckpt / "optim")))
    mc = load_config(ckpt / "config.yaml").model.model_config
    family = family_of(mc)
    out = {}
    for key, t in target.items():
        param, stat = key.removeprefix("state.").rsplit(".", 1)
        # a stacked expert's moments split per expert like the weight (models/llama_moe/hf.py), its step counter
        # repeated for each
        repeat = t.dim() == 0 and ".experts." in param and mc.is_moe
        if repeat:
            t = t.expand(mc.moe_config.expert_num)
        for name, part in to_hf_names({param: t}, family, mc).items():
            out[f"state.{name}.{stat}"] = part.clone() if repeat else part.contiguous()
    save_safetensors(out, where, metadata={"format": "pt", "source": str(ckpt)})
    return len(out)
