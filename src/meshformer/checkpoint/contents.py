"""What a loaded file is, checked before anything trusts it: paths that stay in their folder, and safetensors files
that are what they claim (a header that parses, offsets inside the file, shapes that fit their dtype and bytes).

A manifest proves a file is the one that was hashed, not that it is a checkpoint shard: a file swapped in with
its size and hash written into the manifest passes every checksum. So verification also opens every shard's
header (`safe_open` maps the file and validates the header against its length; no tensor data is read) and
checks that the DCP shard offsets of each tensor cover it exactly once, which is what DCP's reader relies on.
DCP's metadata in this project is those headers (torch's safetensors storage reader builds it from them; no
`.metadata` pickle is written or read).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from meshformer.errors import first_line

DCP_KEY = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY
OFFSETS_KEY = "saved_offsets"


def outside(root: Path, rel: object, extra_roots: tuple[Path, ...] = ()) -> str | None:
    """None when `rel` names a file inside `root` (after following symlinks; `extra_roots` may also hold the
    target), else why not. Checked before the file is opened or even stat'ed."""
    if not isinstance(rel, str) or not rel:
        return f"{rel!r} is not a file name"
    if os.path.isabs(rel) or Path(rel).is_absolute() or rel.startswith(("/", "\\")):
        return f"{rel!r} is an absolute path (entries must stay inside {root})"
    if ".." in Path(rel.replace("\\", "/")).parts:
        return f"{rel!r} climbs out of {root} ('..')"
    target = (root / rel).resolve()
    for allowed in (root, *extra_roots):
        if target == allowed.resolve() or target.is_relative_to(allowed.resolve()):
            return None
    return f"{rel!r} is a symlink pointing outside {root} (to {target})"


def read_header(path: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict] | str:
    """({tensor name: (dtype, shape)}, the header's metadata) of a safetensors file, or why it is not one."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import _TYPES

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {}
            for k in f.keys():
                s = f.get_slice(k)
                tensors[k] = (s.get_dtype(), tuple(s.get_shape()))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        return f"is not a valid safetensors file ({first_line(e)})"
    bad = next((k for k, (dt, _) in tensors.items() if dt not in _TYPES), None)
    if bad is not None:
        return f"is not a valid safetensors file (tensor {bad!r} has dtype {tensors[bad][0]!r})"
    return tensors, meta


def dcp_problem(files: list[Path], root: Path) -> str | None:
    """Why the safetensors shards `files` of one DCP state dict are not a consistent checkpoint, or None: each a
    valid safetensors file, every tensor's saved offsets well formed, its pieces one dtype, covering it once."""
    pieces: dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...]]]] = {}
    for f in files:
        rel = f.relative_to(root).as_posix()
        got = read_header(f)
        if isinstance(got, str):
            return f"{rel} {got}"
        tensors, meta = got
        info = meta.get(DCP_KEY)
        try:
            offsets = json.loads(info) if info is not None else {}
        except ValueError:
            return f"{rel} has unreadable DCP sharding metadata"
        if not isinstance(offsets, dict):
            return f"{rel} has unreadable DCP sharding metadata"
        for k, (dtype, shape) in tensors.items():
            if info is not None and not isinstance(offsets.get(k), dict):
                return f"{rel}: tensor {k!r} has no DCP shard offsets"
            off = offsets[k].get(OFFSETS_KEY) if info is not None else [0] * len(shape)
            if (
                not isinstance(off, list)
                or len(off) != len(shape)
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in off)
            ):
                return f"{rel}: tensor {k!r} has malformed DCP shard offsets {off!r}"
            pieces.setdefault(k, []).append((dtype, tuple(off), shape))
    for k, parts in pieces.items():
        if len({dt for dt, _, _ in parts}) > 1 or len({len(s) for _, _, s in parts}) > 1:
            return f"tensor {k!r} is saved with different dtypes or ranks in different shards"
        full = [max(o[i] + s[i] for _, o, s in parts) for i in range(len(parts[0][2]))]
        boxes = [(o, s) for _, o, s in parts]
        overlap = any(
            all(a[0][i] < b[0][i] + b[1][i] and b[0][i] < a[0][i] + a[1][i] for i in range(len(full)))
            for n, a in enumerate(boxes)
            for b in boxes[n + 1 :]
        )
        if overlap or sum(math.prod(s) for _, s in boxes) != math.prod(full):
            return f"tensor {k!r}: its shards do not cover its {full} shape exactly once (a shard missing or foreign)"
    return None
