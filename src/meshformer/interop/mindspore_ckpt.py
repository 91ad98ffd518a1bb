"""MindSpore checkpoint files read and written without MindSpore: the protobuf `.ckpt` and its safetensors form.

A `.ckpt` is what `mindspore.save_checkpoint` writes (mindspore/train/checkpoint.proto, MindSpore 2.10): a run of
serialized `Checkpoint { repeated Value value = 1 }` messages, each holding one `Value { required string tag = 1;
oneof { TensorProto tensor = 2; MapTensorProto maptensor = 3 } }` with `TensorProto { repeated int64 dims = 1;
required string tensor_type = 2; required bytes tensor_content = 3 }`. Concatenated messages parse as one, so a
parameter over 512 MB is written as several consecutive Values with the same tag whose contents join in order.
`crc_check=True` appends `b"crc_num"` and the CRC-32 of everything before it as 10 big-endian bytes; it is verified
when present. `tensor_type` is MindSpore's dtype name (`Float32`, `BFloat16`, ...); `str` values are strings that
`append_dict` saved and map tensors are embedding hash tables: neither is a model weight, both are passed over.

The safetensors form (`save_checkpoint(..., format="safetensors")`) is a plain safetensors file with metadata
`{"format": "ms"}`; MindSpore flags int4-packed tensors by naming them in that metadata, and those are refused.

Only a consolidated checkpoint is a model: one rank's file of a sharded run holds slices. A folder of `rank_N`
subfolders, a parallel strategy file, or a file in one of several `rank_N` folders is refused in one line that
names MindSpore's merge tools.
"""

from __future__ import annotations

import binascii
import mmap
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshformer.errors import UserError, first_line

CRC_MARK = b"crc_num"
CRC_FOOTER = len(CRC_MARK) + 10  # the mark, then the CRC-32 as 10 big-endian bytes
SLICE_BYTES = 512 * 1024 * 1024  # MindSpore splits a parameter's content into Values of at most this much

DTYPES = {
    "Float32": torch.float32,
    "Float16": torch.float16,
    "BFloat16": torch.bfloat16,
    "Float64": torch.float64,
    "Int8": torch.int8,
    "UInt8": torch.uint8,
    "Int16": torch.int16,
    "Int32": torch.int32,
    "Int64": torch.int64,
    "Bool": torch.bool,
}
TYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
NOT_TENSORS = ("str",)  # MindSpore strings saved with append_dict: run metadata

# What a MindSpore Transformers training checkpoint holds beside the model (CheckpointMonitor's append_info, the
# optimizer's moments, gradient accumulation buffers): passed over on import.
TRAINING_STATE_NAMES = frozenset(
    "epoch_num step_num global_step loss_scale global_batch_size scale_sense current_iterator_step "
    "last_overflow_iterator_step learning_rate beta1_power beta2_power".split()
)
TRAINING_STATE_PREFIXES = ("adam_m.", "adam_v.", "exp_avg.", "exp_avg_sq.", "moments.", "accu_grads.", "inputs.")

RANK_DIR = re.compile(r"rank_\d+")
MERGE_HINT = (
    "merge the shards into one consolidated checkpoint with MindSpore first: "
    "mindspore.transform_checkpoints(SHARDS_DIR, MERGED_DIR, 'model', src_strategy_file=STRATEGY_FILE, "
    "dst_strategy_file=None) writes MERGED_DIR/rank_0/model0.ckpt (safetensors shards: mindspore.unified_safetensors; "
    "pipeline stages: mindspore.merge_pipeline_strategys first; MindSpore Transformers wraps it as "
    "mindformers/tools/transform_ckpt.py), then import that file"
)


@dataclass
class MindSporeCheckpoint:
    tensors: dict[str, torch.Tensor]  # MindSpore's parameter names -> tensors as stored
    training_state: list[str] = field(default_factory=list)  # names passed over: optimizer moments, step counters


def is_training_state(name: str) -> bool:
    return name in TRAINING_STATE_NAMES or name.startswith(TRAINING_STATE_PREFIXES)


def _rank_dirs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_dir() and RANK_DIR.fullmatch(p.name)) if d.is_dir() else []


def _strategy_files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and "strategy" in p.name.lower()) if d.is_dir() else []


def is_mindspore_source(path: Path) -> bool:
    """A MindSpore checkpoint (a .ckpt or .safetensors file) or a folder of one's shards."""
    if not path.is_dir():
        return path.suffix in (".ckpt", ".safetensors")
    return bool(_rank_dirs(path)) or any(path.glob("*.ckpt"))


def _sharded(path: Path, why: str) -> UserError:
    return UserError(f"{path}: a sharded MindSpore checkpoint ({why}): {MERGE_HINT}")


def refuse_sharded(path: Path) -> None:
    """One line naming MindSpore's merge tools for a sharded checkpoint: its folder of rank_N folders, its strategy
    file, or one rank's file of several; one line asking for the file itself for any other folder."""
    if path.is_dir():
        ranks, strategies = _rank_dirs(path), _strategy_files(path)
        if len(ranks) > 1:
            raise _sharded(path, f"{len(ranks)} rank_N folders")
        if strategies:
            raise _sharded(path, f"strategy file {strategies[0].name}")
        files = [f for f in (*path.glob("*"), *path.glob("rank_*/*")) if f.suffix in (".ckpt", ".safetensors")]
        here = ", ".join(sorted(f.relative_to(path).as_posix() for f in files)[:3]) or "none"
        raise UserError(f"{path}: a folder: pass the consolidated .ckpt or .safetensors file itself (here: {here})")
    if "strategy" in path.name.lower():
        raise _sharded(path, "a parallel strategy file, not weights")
    ranks = _rank_dirs(path.parent.parent) if RANK_DIR.fullmatch(path.parent.name) else []
    if len(ranks) > 1:
        raise _sharded(path, f"one rank's file of {len(ranks)}")


def read_mindspore_checkpoint(path: str | Path) -> MindSporeCheckpoint:
    """The tensors of a consolidated `.ckpt` or MindSpore `.safetensors` file, by MindSpore's names."""
    p = Path(path)
    refuse_sharded(p)
    if not p.is_file():
        raise UserError(f"{p}: no such file: give a MindSpore .ckpt or .safetensors checkpoint")
    tensors = _read_safetensors(p) if p.suffix == ".safetensors" else _read_ckpt(p)
    state = sorted(k for k in tensors if is_training_state(k))
    return MindSporeCheckpoint({k: v for k, v in tensors.items() if not is_training_state(k)}, state)


def _read_safetensors(p: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            metadata = f.metadata() or {}
            packed = [k for k in f.keys() if k in metadata]
            if packed:
                raise UserError(
                    f"{p}: tensor {packed[0]} is {metadata[packed[0]]} (int4-packed by MindSpore): meshformer imports "
                    f"unquantized weights; save the checkpoint again from the unquantized model"
                )
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise UserError(f"{p}: not a readable safetensors file ({first_line(e)}): copy it again") from None


def _read_ckpt(p: Path) -> dict[str, torch.Tensor]:
    if p.stat().st_size == 0:
        raise UserError(f"{p}: empty file: not a MindSpore checkpoint")
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        data = memoryview(mm)
        try:
            end = _payload_end(p, data)
            return _tensors_of(p, data, _values(p, data, end))
        finally:
            data.release()


def _payload_end(p: Path, data: memoryview) -> int:
    """Where the protobuf content ends: before the CRC footer when there is one (checked), else the file's end."""
    n = len(data)
    if n < CRC_FOOTER or bytes(data[n - CRC_FOOTER : n - 10]) != CRC_MARK:
        return n
    want = int.from_bytes(data[n - 10 :], "big")
    if binascii.crc32(data[: n - CRC_FOOTER]) != want:
        raise UserError(f"{p}: the CRC-32 MindSpore saved with it does not match its content: the file is damaged")
    return n - CRC_FOOTER


class _Damaged(Exception):
    pass


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Damaged("a truncated number")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(data: memoryview, pos: int, end: int):
    """(field number, wire type, value) of each field in data[pos:end]: a length-delimited value is its (start, stop)
    span, a varint its number, a fixed-width one None (MindSpore's messages have none)."""
    while pos < end:
        key, pos = _varint(data, pos, end)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos, end)
        elif wire == 2:
            size, pos = _varint(data, pos, end)
            if pos + size > end:
                raise _Damaged(f"field {number} runs past the end")
            value, pos = (pos, pos + size), pos + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if pos + width > end:
                raise _Damaged(f"field {number} runs past the end")
            value, pos = None, pos + width
        else:
            raise _Damaged(f"wire type {wire}")
        yield number, wire, value


@dataclass
class _Value:
    tag: str
    dims: list[int]
    tensor_type: str | None  # None: a map tensor
    content: tuple[int, int]


def _values(p: Path, data: memoryview, end: int) -> list[_Value]:
    out: list[_Value] = []
    try:
        for number, wire, span in _fields(data, 0, end):
            if number != 1 or wire != 2:
                raise _Damaged(f"top-level field {number} (a Checkpoint holds only values)")
            out.append(_value(data, *span))
    except (_Damaged, UnicodeDecodeError) as e:
        why = "a parallel strategy file? " if "strategy" in p.name.lower() else ""
        raise UserError(
            f"{p}: not a MindSpore checkpoint ({e}; {why}damaged, truncated or encrypted with enc_key): save it "
            f"again with mindspore.save_checkpoint, without enc_key"
        ) from None
    if not out:
        raise UserError(f"{p}: a MindSpore checkpoint with no tensors in it")
    return out


def _value(data: memoryview, start: int, stop: int) -> _Value:
    tag, tensor, is_map = None, None, False
    for number, wire, span in _fields(data, start, stop):
        if number == 1 and wire == 2:
            tag = bytes(data[span[0] : span[1]]).decode("utf-8")
        elif number == 2 and wire == 2:
            tensor = span
        elif number == 3 and wire == 2:
            is_map = True
    if tag is None or (tensor is None and not is_map):
        raise _Damaged("a value without its name or tensor")
    if tensor is None:
        return _Value(tag, [], None, (0, 0))
    dims: list[int] = []
    tensor_type, content = None, None
    for number, wire, v in _fields(data, *tensor):
        if number == 1 and wire == 0:
            dims.append(v)
        elif number == 1 and wire == 2:  # packed dims, as another writer may encode them
            pos = v[0]
            while pos < v[1]:
                d, pos = _varint(data, pos, v[1])
                dims.append(d)
        elif number == 2 and wire == 2:
            tensor_type = bytes(data[v[0] : v[1]]).decode("utf-8")
        elif number == 3 and wire == 2:
            content = v
    if tensor_type is None or content is None or any(d >= 1 << 62 for d in dims):
        raise _Damaged(f"tensor {tag} lacks its type or content, or has a negative dimension")
    return _Value(tag, dims, tensor_type, content)


def _tensors_of(p: Path, data: memoryview, values: list[_Value]) -> dict[str, torch.Tensor]:
    """Consecutive values with one tag are one parameter's slices, joined in order."""
    tensors: dict[str, torch.Tensor] = {}
    i = 0
    while i < len(values):
        j = i + 1
        while j < len(values) and values[j].tag == values[i].tag:
            j += 1
        first = values[i]
        if first.tag in tensors:
            raise UserError(f"{p}: tensor {first.tag} appears twice: the file is damaged; save it again")
        if first.tensor_type is not None and first.tensor_type not in NOT_TENSORS:
            tensors[first.tag] = _tensor(p, data, values[i:j])
        i = j
    return tensors


def _tensor(p: Path, data: memoryview, parts: list[_Value]) -> torch.Tensor:
    first = parts[0]
    dtype = DTYPES.get(first.tensor_type)
    if dtype is None:
        raise UserError(
            f"{p}: tensor {first.tag} has MindSpore type {first.tensor_type!r}, which meshformer does not import "
            f"(known: {', '.join(DTYPES)})"
        )
    size = sum(v.content[1] - v.content[0] for v in parts)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # MindSpore's loader reads dims [0] as a scalar (its strings are written so)
    shape = [] if first.dims == [0] and size == itemsize else first.dims
    numel = 1
    for d in shape:
        numel *= d
    if size != numel * itemsize:
        raise UserError(
            f"{p}: tensor {first.tag} holds {size} bytes, not the {numel} {first.tensor_type} values of shape "
            f"{shape}: the file is damaged or truncated; save it again"
        )
    buf = bytearray(size)  # a copy: aligned, writable, and free of the file's mapping
    pos = 0
    for v in parts:
        chunk = data[v.content[0] : v.content[1]]
        buf[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype)


def new_output(path: str | Path) -> Path:
    """An export's file name, checked: new (nothing is overwritten), ending in .ckpt or .safetensors."""
    out = Path(path)
    if out.suffix not in (".ckpt", ".safetensors") or out.exists():
        raise UserError(
            f"--output {out}: give a new file name ending in .ckpt (or .safetensors) for --format mindspore"
        )
    return out


def write_mindspore_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `tensors` (MindSpore's names) as a `.ckpt` that `mindspore.load_checkpoint` loads, or with a
    `.safetensors` name as MindSpore's safetensors form; into a sibling temporary file renamed at the end."""
    out = new_output(path)
    bad = next((k for k, t in tensors.items() if t.dtype not in TYPE_NAMES), None)
    if bad is not None:
        raise UserError(f"tensor {bad} is {tensors[bad].dtype}: MindSpore checkpoints hold {', '.join(DTYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp-convert")
    try:
        if out.suffix == ".safetensors":
            from meshformer.checkpoint.safetensors_file import save_safetensors

            save_safetensors({k: t.detach().contiguous() for k, t in tensors.items()}, tmp, metadata={"format": "ms"})
        else:
            with open(tmp, "wb") as f:
                for name, t in tensors.items():
                    _write_tensor(f, name, t)
                f.flush()
                os.fsync(f.fileno())
        tmp.rename(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload_size: int) -> bytes:
    """The key and length of a length-delimited field whose payload follows."""
    return _encode_varint(number << 3 | 2) + _encode_varint(payload_size)


def _write_tensor(f, name: str, t: torch.Tensor) -> None:
    """One Checkpoint message per slice of at most SLICE_BYTES, as MindSpore writes a large parameter."""
    content = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    dims = b"".join(b"\x08" + _encode_varint(d) for d in t.shape)
    type_name = TYPE_NAMES[t.dtype].encode()
    tag = name.encode("utf-8")
    for start in range(0, max(len(content), 1), SLICE_BYTES):
        chunk = content[start : start + SLICE_BYTES]
        tensor_head = dims + _field(2, len(type_name)) + type_name + _field(3, len(chunk))
        tensor_size = len(tensor_head) + len(chunk)
        value_head = _field(1, len(tag)) + tag + _field(2, tensor_size)
        f.write(_field(1, len(value_head) + tensor_size) + value_head + tensor_head)
        f.write(memoryview(chunk))
