"""Sharded checkpoints on torch.distributed.checkpoint (DCP) in safetensors form.

Layout of `{output_dir}/checkpoint/step_{N:08d}/`:
    model/*.safetensors      model weights (DCP, Hugging Face storage: safetensors, no pickle)
    optim/*.safetensors      optimizer tensors (exp_avg, exp_avg_sq, step), flattened by name
    trainer_state.json       step, consumed global batches, layout it was saved under, metrics to resume
    config.yaml              the resolved config of the run
    tokenizer.json           the tokenizer the data was made with (for `meshformer generate`)

Every rank writes its own shards and DCP records where each shard sits, so any layout can load it.
A save goes to `step_N.tmp` and is renamed when complete: a crash never leaves a half checkpoint that
resume would pick.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from meshformer.errors import UserError

STEP_DIR = re.compile(r"^step_(\d+)$")

# DCP warns on every single-process save/load that no process group exists; that is the intended use here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoint"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir itself, or a run's output_dir (its newest checkpoint)."""
    p = Path(path)
    if (p / "trainer_state.json").is_file():
        return p
    found = list_checkpoints(p)
    if found:
        return found[-1]
    raise UserError(f"{str(p)!r} holds no meshformer checkpoint (no trainer_state.json, no checkpoint/step_*): "
                    f"pass a run's output_dir or one of its checkpoint/step_N directories")


def _model_sd(parts) -> dict:
    sd = {}
    for m in parts:
        sd.update(get_model_state_dict(m))
    return sd


def _optim_sd(parts, optimizer) -> dict:
    """Flattened optimizer tensors keyed by parameter name (param_groups come from the config, not the file)."""
    sd = get_optimizer_state_dict(parts if len(parts) > 1 else parts[0], optimizer,
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {k: v for k, v in sd.items() if torch.is_tensor(v)}


def save_checkpoint(path: Path, parts, optimizer, trainer_state: dict, extra_files: dict[str, bytes],
                    is_writer_rank: bool, barrier) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    tmp = path.with_name(path.name + ".tmp")
    if is_writer_rank:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(_model_sd(parts), storage_writer=dcp.HuggingFaceStorageWriter(str(tmp / "model"), save_distributed=True))
    dcp.save(_optim_sd(parts, optimizer), storage_writer=dcp.HuggingFaceStorageWriter(str(tmp / "optim"),
                                                                                        save_distributed=True))
    barrier()
    if is_writer_rank:
        for name, data in extra_files.items():
            (tmp / name).write_bytes(data)
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    barrier()
    return path


def load_model_weights(path: Path, parts) -> None:
    sd = _model_sd(parts)
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(str(path / "model")))
    for m in parts:
        set_model_state_dict(m, sd, options=StateDictOptions(strict=False))


def load_optimizer(path: Path, parts, optimizer) -> None:
    target = _optim_sd(parts, optimizer)
    dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(path / "optim")))
    model = parts if len(parts) > 1 else parts[0]
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    full.update(target)
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(flatten_optimizer_state_dict=True))


def read_trainer_state(path: Path) -> dict:
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}/trainer_state.json is unreadable ({e}): pick another checkpoint") from None


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)

