"""Reading and writing Hugging Face model directories (config.json, safetensors shards + index, tokenizer files).

Reading accepts `model.safetensors`, sharded `model-*.safetensors` with `model.safetensors.index.json`, or
`pytorch_model*.bin` read with `torch.load(weights_only=True)` (tensors only: never unpickles code; a file it
refuses is one line saying to convert it to safetensors). Every file an index names must be inside the directory
(no `../`, no absolute path, no symlink out but a hub cache snapshot's into its own `blobs/`). Names are
translated by the model family's adapter (models/registry.py: by default dropping the `model.` prefix and skipping
old checkpoints' `rotary_emb.inv_freq` buffers, which meshformer computes); a tied `lm_head.weight` is dropped.

Writing produces what `transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load with no missing or unexpected keys: safetensors shards of at most `shard_bytes` (an index when more than
one), config.json, generation_config.json, tokenizer.json and tokenizer_config.json (with the chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from meshformer.checkpoint.contents import outside
from meshformer.checkpoint.safetensors_file import save_safetensors
from meshformer.errors import UserError, first_line
from meshformer.interop.bnb_4bit import check_importable_quantization, dequantize_bnb_4bit, is_bnb_4bit
from meshformer.interop.source import SourceModel

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(
        (path / n).is_file() for n in ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin", BIN_INDEX)
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def hf_roots(d: Path) -> tuple[Path, ...]:
    """Where a model directory's files may live besides the directory itself: a Hugging Face hub cache snapshot
    (`models--org--name/snapshots/<rev>/`) holds symlinks into its repository's `blobs/`, two levels up."""
    return (d.parent.parent,) if d.parent.name == "snapshots" else ()


def _inside(d: Path, rel: object, where: str) -> Path:
    """`d / rel` when it stays inside `d` (or its hub cache repository), else a one-line error naming the entry;
    nothing outside is opened."""
    why = outside(d, rel, hf_roots(d))
    if why is not None:
        raise UserError(f"{where}: weight file {why}: a model directory's files must be inside it")
    return d / rel


def _weight_files(d: Path) -> list[Path]:
    for index_name, single in ((SAFETENSORS_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin")):
        if (d / index_name).is_file():
            weight_map = _read_json(_inside(d, index_name, str(d))).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{d / index_name}: no weight_map")
            bad = next((k for k, v in weight_map.items() if not isinstance(v, str)), None)
            if bad is not None:
                raise UserError(f"{d / index_name}: weight_map[{bad!r}] is {weight_map[bad]!r}, not a file name")
            files = [_inside(d, f, f"{d / index_name}") for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UserError(
                    f"{d}: shard {missing[0]} listed in {index_name} is missing ({len(missing)} of {len(files)} "
                    f"shards): copy the whole model directory"
                )
            return files
        if (d / single).is_file():
            return [_inside(d, single, str(d))]
    raise UserError(f"{d}: no weights found (model.safetensors, {SAFETENSORS_INDEX}, pytorch_model.bin or {BIN_INDEX})")


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as sf:
                    part = {k: sf.get_tensor(k) for k in sf.keys()}
            else:
                part = _load_bin(f)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise UserError(f"{f}: unreadable weights ({str(e).splitlines()[0][:160]})") from None
        if not isinstance(part, dict) or not all(torch.is_tensor(v) for v in part.values()):
            raise UserError(f"{f}: expected a mapping of tensor names to tensors")
        tensors.update(part)
    return tensors


def _load_bin(f: Path) -> object:
    """A `pytorch_model.bin` through `torch.load(weights_only=True)`: tensors and plain containers only. Whatever
    it refuses (pickled objects that could run code) or fails on (a truncated zip, a pre-1.6 non-zip file, any
    other bytes) is one line naming the file: torch raises many exception types on hostile input."""
    import pickle

    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"{f}: holds pickled objects other than tensors, which meshformer never unpickles (torch.load "
            f"weights_only=True refused it): convert it to safetensors where you trust its source, e.g. "
            f"transformers' AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out)"
        ) from None
    except Exception as e:
        raise UserError(
            f"{f}: not a readable PyTorch weights file ({first_line(e, 100)}): it is truncated or damaged, or an old "
            f"non-zip torch.save file; copy it again, or convert it to safetensors where you trust its source"
        ) from None


def read_tokenizer_files(d: Path) -> tuple[str | None, dict]:
    """(tokenizer.json text or None, tokenizer_config.json with `chat_template` filled from chat_template.jinja)."""
    tok = (d / "tokenizer.json").read_text(encoding="utf-8") if (d / "tokenizer.json").is_file() else None
    tok_cfg = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    if "chat_template" not in tok_cfg and (d / "chat_template.jinja").is_file():
        tok_cfg["chat_template"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    return tok, tok_cfg


def read_hf_dir(path: str | Path) -> SourceModel:
    d = Path(path)
    if not (d / "config.json").is_file():
        raise UserError(f"{d}: no config.json: pass a Hugging Face model directory or a .gguf file")
    config = _read_json(d / "config.json")
    check_importable_quantization(config, str(d))
    tensors = _read_tensors(_weight_files(d))
    if is_bnb_4bit(config):  # a bitsandbytes 4-bit save: dequantized to the dtype it records
        tensors = dequantize_bnb_4bit(tensors, str(d))
    tok, tok_cfg = read_tokenizer_files(d)
    return SourceModel(config, tensors, tok, tok_cfg, origin=str(d))


def to_meshformer_names(tensors: dict[str, torch.Tensor], tied: bool, family=None) -> dict[str, torch.Tensor]:
    """Hugging Face names -> ours through the family's adapter (None: a `*ForCausalLM` with a `model.` body); a tied
    model has no head of its own, so a `lm_head.weight` that only repeats the embedding is dropped."""
    from meshformer.models.registry import HF_HEAD, hf_unprefixed

    rename = family.from_hf if family is not None else hf_unprefixed
    out = {}
    for name, t in tensors.items():
        if name == HF_HEAD and tied:
            continue
        ours = rename(name)
        if ours is not None:
            out[ours] = t
    if family is not None and family.from_hf_tensors is not None:
        out = family.from_hf_tensors(out)
    return out


def to_hf_names(state_dict: dict[str, torch.Tensor], family=None, mc=None) -> dict[str, torch.Tensor]:
    """Our names -> Hugging Face's through the family's adapter (None: a `*ForCausalLM` with a `model.` body);
    with the model config `mc`, a family's per-architecture renaming (`to_hf_for`) where it has one."""
    from meshformer.models.registry import hf_prefixed

    if family is None:
        return {hf_prefixed(k): v for k, v in state_dict.items()}
    return family.to_hf_state(state_dict, mc)


def write_hf_dir(
    out: Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    tokenizer_json: str | None,
    tokenizer_config: dict,
    shard_bytes: int,
    weights: bool = True,
) -> list[str]:
    """Write into the (new, empty) directory `out`; returns the weight files written. Without `weights` only the
    config and tokenizer files (beside a PEFT adapter)."""
    if not weights:
        _write_side_files(out, config, tokenizer_json, tokenizer_config)
        return []
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous()
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for shard, name in zip(shards, names):
        save_safetensors(shard, out / name, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: name for shard, name in zip(shards, names) for k in shard},
        }
        (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    _write_side_files(out, config, tokenizer_json, tokenizer_config)
    return names


def _write_side_files(out: Path, config: dict, tokenizer_json: str | None, tokenizer_config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer_json is not None:
        (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
