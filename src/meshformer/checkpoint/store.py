"""Sharded checkpoints on torch.distributed.checkpoint (DCP) in safetensors form.

Layout of `{output_dir}/checkpoint/step_{N:08d}/`:
    model/*.safetensors      model weights (DCP, Hugging Face storage: safetensors, no pickle)
    optim/*.safetensors      optimizer tensors (exp_avg, exp_avg_sq, step), flattened by name
    trainer_state.json       step (= consumed global batches), global batch, seed, seq_length, layout
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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshformer.errors import UserError

STEP_DIR = re.compile(r"^step_(\d+)$")


def _dcp(fn, *args, **kwargs):
    """Call a DCP function. In one process DCP warns on every call that no process group exists, which is the
    intended use here: that one warning is silenced for the call only (no filter outlives it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


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
    raise UserError(
        f"{str(p)!r} holds no meshformer checkpoint (no trainer_state.json, no checkpoint/step_*): "
        f"pass a run's output_dir or one of its checkpoint/step_N directories"
    )


def _model_sd(parts) -> dict:
    sd = {}
    for m in parts:
        sd.update(get_model_state_dict(m))
    return sd


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _optim_sd(parts, optimizers) -> dict:
    """Flattened optimizer tensors keyed by parameter name (param_groups come from the config, not the file).

    `optimizers` holds one optimizer per part (train.optim.Optimizers.items)."""
    sd = {}
    for m, o in zip(parts, optimizers):
        sd.update({k: v for k, v in get_optimizer_state_dict(m, o, options=FLAT).items() if torch.is_tensor(v)})
    return sd


def save_checkpoint(
    path: Path, parts, optimizers, trainer_state: dict, extra_files: dict[str, bytes], is_writer_rank: bool, barrier
) -> Path:
    """Collective: every rank calls it. Returns the final directory."""
    tmp = path.with_name(path.name + ".tmp")
    if is_writer_rank:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    for sd, sub in ((_model_sd(parts), "model"), (_optim_sd(parts, optimizers), "optim")):
        _dcp(dcp.save, sd, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp / sub), save_distributed=True))
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
    _dcp_load(sd, path / "model")
    for m in parts:
        set_model_state_dict(m, sd, options=StateDictOptions(strict=False))


def load_optimizer(path: Path, parts, optimizers) -> None:
    fulls = [get_optimizer_state_dict(m, o, options=FLAT) for m, o in zip(parts, optimizers)]
    target = {k: v for full in fulls for k, v in full.items() if torch.is_tensor(v)}
    _dcp_load(target, path / "optim")
    for m, o, full in zip(parts, optimizers, fulls):  # dcp.load filled the tensors of `fulls` in place
        set_optimizer_state_dict(m, o, full, options=FLAT)


def _dcp_load(sd: dict, where: Path) -> None:
    """DCP load whose failures (missing tensors, wrong shapes) become a one-line UserError."""
    try:
        _dcp(dcp.load, sd, storage_reader=dcp.HuggingFaceStorageReader(str(where)))
    except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
        detail = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"checkpoint {str(where.parent)!r} does not fit this model ({detail}): use the model "
            f"settings of the config.yaml saved next to it"
        ) from None


def read_trainer_state(path: Path) -> dict:
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}/trainer_state.json is unreadable ({e}): pick another checkpoint") from None


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    for old in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
