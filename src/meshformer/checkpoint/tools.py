"""What `meshformer ckpt info` and `ckpt verify` do: describe and verify checkpoints, without building a model or a
process group (`ckpt merge`, a Hugging Face directory out, is interop/merge.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from meshformer.checkpoint import store
from meshformer.checkpoint.manifest import read_manifest, verify
from meshformer.config.yaml_text import load_yaml_text
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
        aside = store.set_aside_checkpoints(p)
        also = f"; {len(aside)} damaged one(s) set aside for repair: {aside[0]}, ..." if aside else ""
        raise UserError(f"{str(p)!r} holds no checkpoint (no checkpoint/step_*{also}): pass a run's output_dir")
    return found


def info(ckpt: Path) -> dict:
    """Step, layout, model shape, tensor counts and sizes of one checkpoint, and whether it is complete."""
    out: dict = {"path": str(ckpt), "status": verify(ckpt, full=False) or "complete (sizes match the manifest)"}
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        state = state if isinstance(state, dict) else {}  # a list or a number: verify names it (status)
        out.update({k: state.get(k) for k in ("step", "global_batch", "seed", "seq_length", "layout", "finite")})
    except (OSError, ValueError):
        out["step"] = None
    try:
        mc = (
            (load_yaml_text((ckpt / "config.yaml").read_text(), f"{ckpt}/config.yaml") or {})
            .get("model", {})
            .get("model_config", {})
        )
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
