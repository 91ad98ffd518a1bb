"""`data_loader.type: BlendedMegatronDatasetDataLoader`: MindSpore Transformers' Megatron blend block, read as
written, giving the trainer Megatron's GPTDataset / BlendedDataset samples in Megatron's order.

A sample is Megatron's `text` (seq_length + 1 tokens) with Megatron's masks, in meshformer's terms
(data/protocol.py Sample, whose loss_mask is indexed by the target):
- loss_mask[k] is False where text[k] is the pad id (Megatron masks labels equal to pad, and pads a short last
  sample with it; such tokens become 0), and, with eod_mask_loss, where text[k - 1] is eod: Megatron's
  `loss_mask[tokens == eod] = 0` drops the target whose *input* is the eod token, i.e. the next document's first
  token;
- with reset_attention_mask and reset_position_ids, `documents` counts the eod tokens before each position, so
  attention and rotary positions restart after every eod as Megatron's masks and position ids do. meshformer
  restarts both together and does not train the target across a document boundary (the label after an eod),
  which Megatron trains unless eod_mask_loss is set.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from meshformer.data.formats import register_dataset_format
from meshformer.data.megatron.blend import SPLITS
from meshformer.data.megatron.builder import BlendedSplit, SplitRequest, build_split
from meshformer.data.megatron.gpt_dataset import GPTSettings
from meshformer.data.protocol import Sample, identity
from meshformer.data.tokenizer import load_tokenizer, vocab_size
from meshformer.errors import UserError

FORMAT = "megatron-blend"
SPLIT_OF = {"train": 0, "validation": 1}


class MegatronBlendDataset:
    """One split of a Megatron blend: Megatron's sample i is `sample(i)`, and the index order is the training order."""

    ordered = True

    def __init__(self, split: BlendedSplit, cfg, split_name: str, tokenizer: Path | None, field: str):
        self.split, self.split_name = split, split_name
        self.eod, self.pad = cfg.eod, _pad_id(cfg)
        self.special_ids = {f"{field}.config.eod": cfg.eod} if cfg.eod >= 0 else {}
        self.eod_mask_loss = cfg.eod_mask_loss
        self.reset = cfg.reset_attention_mask and cfg.reset_position_ids
        self._settings = (cfg.seed, cfg.split, cfg.add_extra_token_to_sequence)
        self.tokenizer_file = tokenizer
        self.tokenizer_hash = None if tokenizer is None else hashlib.sha256(tokenizer.read_bytes()).hexdigest()
        self.vocab_size = None if tokenizer is None else vocab_size(load_tokenizer(tokenizer))
        self._state = None

    def __len__(self) -> int:
        return len(self.split)

    @property
    def source(self) -> str:
        """Its datasets' prefixes, for errors."""
        return ", ".join(d.file.prefix for d in self.split.datasets)

    def sample(self, i: int) -> Sample:
        if not 0 <= i < len(self.split):
            raise IndexError(i)
        text = self.split.text(i)
        if len(text) == self.split.datasets[0].seq:  # add_extra_token_to_sequence false: the last label is padding
            text = np.append(text, self.pad)
        is_pad = text == self.pad
        loss_mask = ~is_pad
        if self.eod_mask_loss:
            loss_mask[1:] &= text[:-1] != self.eod
        documents = None
        if self.reset:
            documents = torch.from_numpy(np.concatenate(([0], np.cumsum(text[:-1] == self.eod))).astype(np.int64))
        tokens = torch.from_numpy(np.where(is_pad, 0, text))
        return Sample(tokens, torch.from_numpy(loss_mask), documents)

    def blend_description(self) -> dict:
        ds = self.split.datasets
        seed, split, extra = self._settings
        return {
            "split": self.split_name,
            "prefixes": [d.file.prefix for d in ds],
            "weights": self.split.weights,
            "shares": split,
            "seed": seed,
            "seq_length": ds[0].seq,
            "add_extra_token_to_sequence": extra,
        }

    def state_dict(self) -> dict:
        if self._state is None:
            self._state = {**identity(self, FORMAT), "blend": self.blend_description()}
        return self._state

    def describe(self) -> dict:
        """Documents and tokens of each dataset's split, samples drawn from each and the realised proportions."""
        ds, counts = self.split.datasets, self.split.samples_per_dataset()
        total = max(sum(counts), 1)
        per = [
            {
                "prefix": d.file.prefix,
                "documents": len(d.document_index) // d.num_epochs,
                "tokens": d.tokens_per_epoch,
                "epochs": d.num_epochs,
                "samples_built": len(d),
                "samples_drawn": n,
                "weight": None if self.split.weights is None else round(self.split.weights[k], 6),
                "proportion": round(n / total, 6),
            }
            for k, (d, n) in enumerate(zip(ds, counts))
        ]
        return {
            "documents": sum(p["documents"] for p in per),
            "tokens": sum(p["tokens"] for p in per),
            "samples_per_dataset": counts,
            "blend_proportions": [p["proportion"] for p in per],
            "datasets": per,
        }


def _pad_id(cfg) -> int:
    """Megatron's pad id: config.pad, unless it is the eod id (then -1, which no token equals: MegatronDataset)."""
    return -1 if cfg.pad == cfg.eod else cfg.pad


def _check_config(dl, split: str, seq_length: int, field: str) -> None:
    cfg, where = dl.config, f"{field}.config"
    if split not in SPLIT_OF:
        raise UserError(f"{field}: split {split!r}: a Megatron blend gives 'train' or 'validation'")
    if cfg.seq_length is not None and cfg.seq_length != seq_length:
        raise UserError(
            f"{where}.seq_length={cfg.seq_length} differs from model.model_config.seq_length={seq_length}: "
            f"set them equal (or leave config.seq_length unset)"
        )
    if cfg.reset_attention_mask != cfg.reset_position_ids:
        raise UserError(
            f"{where}: reset_attention_mask={cfg.reset_attention_mask} but reset_position_ids="
            f"{cfg.reset_position_ids}: meshformer restarts attention and positions together at eod, "
            f"set both or neither"
        )
    if cfg.eod < -1:
        raise UserError(f"{where}.eod={cfg.eod}: give the data's end-of-document token id, or -1 for none")
    if cfg.eod < 0 and (cfg.eod_mask_loss or cfg.reset_attention_mask):
        raise UserError(
            f"{where}.eod is not set (-1) but eod_mask_loss/reset_attention_mask need it: set config.eod to the "
            f"data's end-of-document token id"
        )
    if cfg.s3_cache_path:
        raise UserError(f"{where}.s3_cache_path: only local files are read; remove it and copy the data locally")
    if seq_length < 2:
        raise UserError(f"model.model_config.seq_length={seq_length}: a Megatron sample needs at least 2 tokens")


def _sizes(dl, field: str) -> list[int | None]:
    sizes = list(dl.sizes or [])
    if len(sizes) > len(SPLITS) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise UserError(f"{field}.sizes={sizes!r}: give up to three sample counts >= 0 (train, validation, test)")
    sizes += [0] * (len(SPLITS) - len(sizes))
    return [s or None for s in sizes]  # 0: one epoch (Megatron would build none, or refuse, for a weighted blend)


def _tokenizer_beside(split: BlendedSplit, field: str) -> Path | None:
    """tokenizer.json beside every prefix (the same one), else None (none beside any; beside only some: refused)."""
    found = {Path(d.file.prefix).parent / "tokenizer.json" for d in split.datasets}
    missing = sorted(f for f in found if not f.is_file())
    if len(missing) == len(found):
        return None
    if missing:  # the datasets without one may come from another tokenizer: nothing could tell
        raise UserError(
            f"{field}.config.data_path: {missing[0]} is missing but {min(found - set(missing))} exists: a "
            f"blend needs data made with one tokenizer: copy that tokenizer.json beside every dataset"
        )
    hashes = {hashlib.sha256(f.read_bytes()).hexdigest(): f for f in found}
    if len(hashes) > 1:
        raise UserError(
            f"{field}.config.data_path: the datasets' tokenizer.json files differ ({', '.join(map(str, found))}): "
            f"a blend needs data made with one tokenizer"
        )
    return next(iter(hashes.values()))


def open_megatron_blend(dl, split: str, seq_length: int, field: str) -> MegatronBlendDataset:
    _check_config(dl, split, seq_length, field)
    cfg = dl.config
    settings = GPTSettings(
        seed=cfg.seed,
        seq_length=seq_length,
        add_extra_token=cfg.add_extra_token_to_sequence,
        drop_last_partial_validation=cfg.drop_last_partial_validation_sequence,
    )
    index = SPLIT_OF[split]
    req = SplitRequest(
        index, _sizes(dl, field)[index], settings, _pad_id(cfg), cfg.num_dataset_builder_threads, f"{field}.config"
    )
    built = build_split(cfg, req)
    return MegatronBlendDataset(built, cfg, split, _tokenizer_beside(built, field), field)


register_dataset_format("BlendedMegatronDatasetDataLoader", open_megatron_blend)
