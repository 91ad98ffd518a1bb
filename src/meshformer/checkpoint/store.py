"""Sharded checkpoints on torch.distributed.checkpoint (DCP) in safetensors form.

Layout of `{output_dir}/checkpoint/step_{N:08d}/`:
    model/*.safetensors      model weights (DCP, Hugging Face storage: safetensors, no pickle)
    optim/*.safetensors      optimizer tensors (exp_avg, exp_avg_sq, step), flattened by name
    trainer_state.json       step (= consumed global batches), global batch, seed, seq_length, layout, finite
    config.yaml              the resolved config of the run
    tokenizer.json           the tokenizer the data was made with (for `meshformer generate`)
    manifest.json            every file above with its size and SHA-256, written last (checkpoint/manifest.py)

Every rank writes its own shards and DCP records where each shard sits, so any layout can load it.
Saving (in line or in the background) is `saver.py`: a save goes to `step_N.tmp`, gets its manifest, and only
then replaces `step_N`, so a crash never leaves a half checkpoint that resume would pick, and a failed save
(a full disk) leaves every earlier checkpoint as it was. This module finds, verifies, loads and prunes
checkpoints; loading verifies the manifest and is strict: every tensor of the model present with its shape,
and nothing else. "Verifies" covers what the files are too, not only their checksums (manifest.verify): a shard
swapped in with a manifest rewritten to match is a bad checkpoint, which resume skips like any other.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from meshformer.checkpoint.manifest import MANIFEST, verify
from meshformer.errors import UserError

STEP_DIR = re.compile(r"^step_(\d+)$")


def dcp_call(fn, *args, **kwargs):
    """Call a DCP function. In one process DCP warns on every call that no process group exists, which is the
    intended use here: that one warning is silenced for the call only (no filter outlives it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        return fn(*args, **kwargs)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoint"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Every `step_N` directory of a run, oldest first, complete or not (see `verify`)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def is_checkpoint_dir(path: Path) -> bool:
    return (path / MANIFEST).exists() or (path / "trainer_state.json").exists() or bool(STEP_DIR.match(path.name))


def newest_good(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(newest checkpoint that verifies in full, [(newer ones skipped, why)])."""
    skipped = []
    for ckpt in reversed(list_checkpoints(output_dir)):
        why = verify(ckpt, full=True)
        if why is None:
            return ckpt, skipped
        skipped.append((ckpt, why))
    return None, skipped


def resolve_checkpoint(path: str | Path, notes: list[str] | None = None) -> Path:
    """A checkpoint directory (verified), or a run's output_dir: its newest checkpoint that verifies, the newer
    broken ones reported in `notes`. Anything else is a one-line UserError naming what is wrong."""
    p = Path(path)
    if is_checkpoint_dir(p):
        why = verify(p, full=True)
        if why is not None:
            raise UserError(
                f"checkpoint {str(p)!r} is not usable: {why}; pass an earlier checkpoint, or the run's "
                f"output_dir to pick its newest good one"
            )
        return p
    good, skipped = newest_good(p)
    for ckpt, why in skipped:
        if notes is not None:
            notes.append(f"skipped checkpoint {ckpt}: {why}")
    if good is not None:
        return good
    if skipped:
        raise UserError(f"{str(p)!r} holds no usable checkpoint: " + "; ".join(f"{c.name}: {w}" for c, w in skipped))
    raise UserError(
        f"{str(p)!r} holds no meshformer checkpoint (no manifest.json, no checkpoint/step_*): "
        f"pass a run's output_dir or one of its checkpoint/step_N directories"
    )


DAMAGED = ".damaged"  # `step_N.damaged`: a checkpoint that failed verification, set aside (never deleted)
SET_ASIDE_DIR = re.compile(r"^step_\d+\.damaged(-\d+)?$")


def set_aside_checkpoints(output_dir: str | Path) -> list[Path]:
    """The damaged checkpoints `set_aside` renamed (`step_N.damaged`, `step_N.damaged-2`, ...), by name."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if SET_ASIDE_DIR.match(p.name) and p.is_dir())


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged `step_N` to `step_N.damaged` (`.damaged-2`, ... when taken) and return where it went.

    Set aside, a checkpoint that failed verification is no longer a `step_N`: a save of that step cannot replace
    it, pruning neither counts nor deletes it, a replacing run does not move it, and resume does not verify it
    again. Its files stay as they are, for repair (a lost manifest.json, one bad shard among good ones)."""
    target, n = ckpt.with_name(ckpt.name + DAMAGED), 1
    while target.exists() or target.is_symlink():
        n += 1
        target = ckpt.with_name(f"{ckpt.name}{DAMAGED}-{n}")
    ckpt.rename(target)
    return target


def clean_leftovers(output_dir: str | Path) -> list[Path]:
    """Remove `step_N.tmp` / `step_N.old` directories that a killed save left behind (names only saves create).
    A `step_N.old` without its `step_N` is that step's one complete copy (a save killed between the two renames
    of `saver.replace_dir`): it is renamed back to `step_N`, which resume then verifies like any other."""
    root = checkpoint_root(output_dir)
    gone = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.is_dir() and re.match(r"^step_\d+\.(tmp|old)$", p.name):
                if p.suffix == ".old" and not (root / p.stem).exists():
                    p.rename(root / p.stem)
                    continue
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p)
    return gone


def model_state_dict(parts) -> dict:
    """The parts' tensors a checkpoint holds: all but a QLoRA run's NF4 base weights, which are frozen and
    quantized again from the run's base source on resume (the same weights give the same codes)."""
    from meshformer.models.qlora import is_nf4

    sd = {}
    for m in parts:
        sd.update({k: v for k, v in get_model_state_dict(m).items() if not is_nf4(v)})
    return sd


def nf4_shapes(parts) -> dict[str, tuple[int, ...]]:
    """{name: full shape} of the parts' NF4 (QLoRA base) weights."""
    from meshformer.models.init import canonical_name
    from meshformer.models.qlora import is_nf4

    return {canonical_name(n): tuple(p.shape) for m in parts for n, p in m.named_parameters() if is_nf4(p)}


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state_dict(parts, optimizers) -> dict:
    """Flattened optimizer tensors keyed by parameter name (param_groups come from the config, not the file).

    `optimizers` holds one optimizer per part (train.optim.Optimizers.items)."""
    sd = {}
    for m, o in zip(parts, optimizers):
        sd.update({k: v for k, v in get_optimizer_state_dict(m, o, options=FLAT).items() if torch.is_tensor(v)})
    return sd


def reason(e: BaseException) -> str:
    """The root cause of a failed write in a few words (DCP wraps every rank's exception)."""
    seen = e
    for _ in range(8):
        nxt = seen.__cause__ or seen.__context__
        if nxt is None:
            break
        seen = nxt
    text = (str(seen).strip().splitlines() or [type(seen).__name__])[-1]
    if isinstance(e, CheckpointException):
        for _, exc in getattr(e, "failures", {}).items():
            text = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            break
    return text[:200]


def tensor_metadata(where: Path) -> dict:
    """{tensor name: DCP tensor metadata (size, dtype)} of one saved state dict, no tensor data read."""
    md = dcp_call(dcp.HuggingFaceStorageReader(str(where)).read_metadata)
    return {k: v for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a checkpoint's model weights."""
    try:
        meta = tensor_metadata(path / "model")
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise UserError(f"checkpoint {str(path)!r}: its model metadata is unreadable ({reason(e)})") from None
    return {k: tuple(v.size) for k, v in meta.items()}


def shape_problems(have: dict, expected: dict, complete: bool = True) -> list[str]:
    """What keeps tensors `have` ({name: shape}) from being the model `expected`, in a few words each."""
    missing = sorted(set(expected) - set(have))
    extra = sorted(set(have) - set(expected)) if complete else []
    wrong = sorted(k for k in set(expected) & set(have) if tuple(expected[k]) != tuple(have[k]))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing, e.g. {missing[0]}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) this model does not have, e.g. {extra[0]}")
    if wrong:
        k = wrong[0]
        problems.append(f"{len(wrong)} shape(s) differ, e.g. {k} is {list(have[k])} there, {list(expected[k])} here")
    return problems


def check_model_fits(path: Path, expected: dict[str, tuple[int, ...]], complete: bool = True) -> None:
    """Strict load: every expected tensor present with its shape; with `complete`, no tensor the model lacks."""
    problems = shape_problems(checkpoint_shapes(path), expected, complete)
    if problems:
        raise UserError(
            f"checkpoint {str(path)!r} does not fit this model ({'; '.join(problems)}): use the model "
            f"settings of the config.yaml saved next to it"
        )


def load_model_weights(path: Path, parts, expected: dict[str, tuple[int, ...]] | None = None, rename=None) -> None:
    """Load weights into this rank's parts. `expected`: {name: shape} of the whole model, checked strictly
    against the checkpoint first (default: the parts' own tensors, which must all be present).

    `rename(model key) -> checkpoint key, or None for a tensor the checkpoint does not hold`: base weights into a
    transformed model (a LoRA linear's `q_proj.base_layer.weight` is the base model's `q_proj.weight`, its
    adapters start fresh); `expected` is then in the checkpoint's names."""
    sd = model_state_dict(parts)
    wanted = sd if rename is None else {rename(k): v for k, v in sd.items() if rename(k) is not None}
    nf4 = nf4_shapes(parts)
    if expected is None:
        check_model_fits(path, {k: tuple(v.shape) for k, v in wanted.items()}, complete=False)  # DTensor: global
    elif rename is None:  # a checkpoint of this run: everything but the NF4 base (model_state_dict)
        check_model_fits(path, {k: v for k, v in expected.items() if k not in nf4})
    else:
        check_model_fits(path, expected)
    _dcp_load(wanted, path / "model")  # fills the tensors of `sd` in place (`wanted` holds the same objects)
    for m in parts:
        set_model_state_dict(m, sd, options=StateDictOptions(strict=False))
    if rename is not None and nf4:  # base weights into a QLoRA model: whole on every rank, then quantized
        full = {rename(k): torch.empty(shape) for k, shape in nf4.items()}
        _dcp_load(full, path / "model")
        for m in parts:
            fill_nf4_weights(m, {k: full[rename(k)] for k in nf4})


def load_full_weights(parts, tensors: dict[str, torch.Tensor]) -> None:
    """Load full (unsharded) tensors, the same on every rank, into this rank's parts: DTensor parameters take
    their own shard, pipeline stages their own layers (names they lack are not theirs)."""
    from meshformer.models.init import canonical_name

    for m in parts:
        names = {canonical_name(n) for n in m.state_dict()}  # a compiled layer's names hold `_orig_mod.`
        nf4 = fill_nf4_weights(m, tensors)
        mine = {k: v for k, v in tensors.items() if k in names and k not in nf4}
        set_model_state_dict(m, mine, options=StateDictOptions(full_state_dict=True, strict=False))


def fill_nf4_weights(part, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Quantize the full tensors of `part`'s NF4 (QLoRA base) weights into them, every rank from the whole weight
    (models/qlora.py `fill_nf4`); returns their names."""
    from meshformer.models.init import canonical_name
    from meshformer.models.qlora import fill_nf4, is_nf4

    filled = set()
    for name, p in part.named_parameters():
        key = canonical_name(name)
        if key in tensors and is_nf4(p):
            fill_nf4(p, tensors[key])
            filled.add(key)
    return filled


def load_optimizer(path: Path, parts, optimizers) -> None:
    fulls = [get_optimizer_state_dict(m, o, options=FLAT) for m, o in zip(parts, optimizers)]
    target = {k: v for full in fulls for k, v in full.items() if torch.is_tensor(v)}
    _dcp_load(target, path / "optim")
    for m, o, full in zip(parts, optimizers, fulls):  # dcp.load filled the tensors of `fulls` in place
        set_optimizer_state_dict(m, o, full, options=FLAT)


def _dcp_load(sd: dict, where: Path) -> None:
    """DCP load whose failures (missing tensors, wrong shapes) become a one-line UserError."""
    try:
        dcp_call(dcp.load, sd, storage_reader=dcp.HuggingFaceStorageReader(str(where)))
    except (CheckpointException, RuntimeError, ValueError, KeyError, SafetensorError) as e:
        detail = str(e).strip().splitlines()[-1][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"checkpoint {str(where.parent)!r} does not fit this model ({detail}): use the model "
            f"settings of the config.yaml saved next to it"
        ) from None


def read_trainer_state(path: Path) -> dict:
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}/trainer_state.json is unreadable ({e}): pick another checkpoint") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError(f"{path}/trainer_state.json has no valid step (got {step!r}): pick another checkpoint")
    return state


# trainer_state.json: what a PEFT adapter exported from this checkpoint names as its base (a Hugging Face id or
# directory: interop/convert.py records it at import, the trainer carries it from load_checkpoint), or absent
BASE_KEY = "base_model_name_or_path"


def recorded_base(ckpt: Path) -> str | None:
    """The Hugging Face base a checkpoint records (None when it records none: trained from scratch, a GGUF import,
    or saved before the record existed)."""
    try:
        value = json.loads((ckpt / "trainer_state.json").read_text()).get(BASE_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def prune_checkpoints(output_dir: str | Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep`, but never the newest one saved with a finite loss
    (a run that went NaN keeps its last good state). Incomplete or damaged directories are left alone: they
    may be something to inspect, and resume skips them anyway. Returns what was deleted."""
    complete = [p for p in list_checkpoints(output_dir) if verify(p, full=False) is None]
    keep_set = set(complete[-keep:])
    finite = [p for p in complete if saved_finite(p)]
    if finite:
        keep_set.add(finite[-1])
    best = [p for p in complete if _state_flag(p, "best", False)]
    if best:  # early stopping's best checkpoint (train/early_stop.py)
        keep_set.add(best[-1])
    gone = [p for p in complete if p not in keep_set]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def saved_finite(path: Path) -> bool:
    return _state_flag(path, "finite", True)


def _state_flag(path: Path, key: str, default: bool) -> bool:
    """A boolean of a checkpoint's trainer_state.json (False when it is unreadable)."""
    try:
        return bool(json.loads((path / "trainer_state.json").read_text()).get(key, default))
    except (OSError, ValueError, AttributeError):
        return False
