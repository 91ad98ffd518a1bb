"""What `meshformer ckpt` does: describe, verify and merge checkpoints, without building a model or a process group."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml

from meshformer.checkpoint import store
from meshformer.checkpoint.manifest import read_manifest, verify
from meshformer.errors import UserError


def checkpoints_of(path: str | Path) -> list[Path]:
    """A checkpoint directory itself, or every `step_N` of a run directory (oldest first)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{str(p)!r} does not exist: pass a run's output_dir or one of its checkpoint/step_N")
    if store.is_checkpoint_dir(p):
        return [p]
    found = store.list_checkpoints(p)
    if not found:
        raise UserError(f"{str(p)!r} holds no checkpoint (no checkpoint/step_*): pass a run's output_dir")
    return found


def info(ckpt: Path) -> dict:
    """Step, layout, model shape, tensor counts and sizes of one checkpoint, and whether it is complete."""
    out: dict = {"path": str(ckpt), "status": verify(ckpt, full=False) or "complete (sizes match the manifest)"}
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        out.update({k: state.get(k) for k in ("step", "global_batch", "seed", "seq_length", "layout", "finite")})
    except (OSError, ValueError):
        out["step"] = None
    try:
        mc = (yaml.safe_load((ckpt / "config.yaml").read_text()) or {}).get("model", {}).get("model_config", {})
        out["model"] = {
            k: mc.get(k)
            for k in (
                "type",
                "hidden_size",
                "num_layers",
                "num_heads",
                "n_kv_heads",
                "vocab_size",
                "intermediate_size",
                "tie_word_embeddings",
            )
        }
    except (OSError, yaml.YAMLError, AttributeError):
        out["model"] = None
    for part, key in (("model", "weights"), ("optim", "optimizer")):
        files = sorted((ckpt / part).glob("*")) if (ckpt / part).is_dir() else []
        entry = {"files": len(files), "bytes": sum(f.stat().st_size for f in files if f.is_file())}
        if part == "model" and files:
            try:
                meta = store.tensor_metadata(ckpt / "model")
                entry["tensors"] = len(meta)
                entry["parameters"] = sum(int(torch.Size(v.size).numel()) for v in meta.values())
            except Exception as e:  # a damaged shard index: report, do not crash the report
                entry["error"] = str(e).splitlines()[-1][:120] if str(e) else type(e).__name__
        out[key] = entry
    m = read_manifest(ckpt)
    out["manifest_files"] = len(m["files"]) if m else None
    return out


def full_verify(ckpt: Path) -> str | None:
    """The manifest (sizes and SHA-256 of every file), then every tensor of every shard read back."""
    why = verify(ckpt, full=True)
    if why is not None:
        return why
    from safetensors import safe_open

    for f in sorted(ckpt.rglob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    st.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for a bad header or offsets
            return f"{f.relative_to(ckpt)} cannot be read ({str(e).splitlines()[0][:120]})"
    return None


def merge(ckpt: Path, output: Path, overwrite: bool = False, with_optimizer: bool = False) -> dict:
    """All model tensors (and optionally optimizer state under `optim.`), whatever layout saved them, into one
    safetensors file (written to a temporary name, then renamed: an existing file is replaced only with
    `overwrite`, and only once the new one is complete)."""
    from safetensors.torch import save_file

    why = verify(ckpt, full=True)
    if why is not None:
        raise UserError(f"checkpoint {str(ckpt)!r} is not usable: {why}")
    if output.exists() and (output.is_dir() or not overwrite):
        raise UserError(f"--output={str(output)!r} already exists: pass --overwrite to replace it, or another path")
    sd: dict[str, torch.Tensor] = {}
    parts = [("model", "")] + ([("optim", "optim.")] if with_optimizer else [])
    for sub, prefix in parts:
        meta = store.tensor_metadata(ckpt / sub)
        target = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in meta.items()}
        store.dcp_call(dcp.load, target, storage_reader=dcp.HuggingFaceStorageReader(str(ckpt / sub)))
        sd.update({prefix + k: t.contiguous() for k, t in target.items()})
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        save_file(sd, str(tmp), metadata={"format": "pt", "source": str(ckpt)})
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return {"tensors": len(sd), "bytes": output.stat().st_size, "output": str(output)}
