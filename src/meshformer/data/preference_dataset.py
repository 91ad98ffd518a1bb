"""The preference dataset (data/preference.py writes it) as the trainer reads it: one sample per pair, or per
unpaired (KTO) example, through the same protocol as every format (data/protocol.py `PreferenceSample`, a `Sample`
whose tokens and loss_mask are the chosen sequence and its completion mask, with the rejected sequence and mask
beside them; a KTO sample has the completion's sequence and its `label` instead).

Each sequence is a row of seq_length + 1 tokens padded with the pad id (mask 0), as instruction samples are; one
longer than that is cut at seq_length + 1 (preprocess's max_length is the place to choose where sequences end).
Registered as `data_loader.type: PreferenceDataset`; `MindDataset` with a preference directory opens it too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshformer.data import protocol
from meshformer.data.dataset import PREFERENCE_FORMAT as FORMAT  # = data/preference.py FORMAT (no torch there)
from meshformer.data.dataset import _tokenizer_of, load_offsets, map_array, map_masked_split, pad_id, read_meta
from meshformer.data.formats import register_dataset_format
from meshformer.data.protocol import PreferenceSample
from meshformer.errors import UserError


class PreferenceDataset:
    def __init__(self, dataset_dir: str | Path, split: str, seq_length: int, field: str):
        self.dir = Path(dataset_dir)
        self.meta = read_meta(dataset_dir, field)
        self.split, self.seq_length = split, seq_length
        self.kind = self.meta.get("kind")
        if self.meta.get("format") != FORMAT or self.kind not in ("pairs", "unpaired"):
            raise UserError(f"{self.dir / 'meta.json'}: not a preference dataset: re-run `meshformer preprocess`")
        what = ("preference examples", "records")
        info, self.tokens, self.masks = map_masked_split(self.dir, self.meta, split, field, what)
        self.per = 2 if self.kind == "pairs" else 1
        sequences = info["samples"] * self.per
        self.offsets = load_offsets(self.dir / f"{split}.idx.npy", sequences, info["tokens"])
        self.labels = None
        if self.kind == "unpaired":
            self.labels = map_array(self.dir / f"{split}.label.bin", np.dtype(np.uint8), info["samples"], "labels")
        self.pad = pad_id(self.dir, self.meta)
        self.samples = info["samples"]
        _tokenizer_of(self)

    def __len__(self) -> int:
        return self.samples

    def _row(self, data: np.ndarray, k: int, fill: int) -> torch.Tensor:
        row = np.full(self.seq_length + 1, fill, dtype=np.int64)
        a = int(self.offsets[k])
        m = min(int(self.offsets[k + 1]) - a, self.seq_length + 1)
        row[:m] = data[a : a + m]
        return torch.from_numpy(row)

    def _sequence(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._row(self.tokens, k, self.pad), self._row(self.masks, k, 0).bool()

    def sample(self, i: int) -> PreferenceSample:
        tokens, mask = self._sequence(i * self.per)
        if self.kind == "unpaired":
            return PreferenceSample(tokens, mask, label=bool(self.labels[i]))
        rejected, rejected_mask = self._sequence(i * self.per + 1)
        return PreferenceSample(tokens, mask, rejected=rejected, rejected_mask=rejected_mask)

    def describe(self) -> dict:
        """`meshformer data stats`: pairs (or KTO examples), tokens, and what preprocess counted."""
        lengths = np.diff(self.offsets)
        report = self.meta.get("report", {})
        stats = {"kind": self.kind, "pairs" if self.kind == "pairs" else "examples": self.samples}
        if self.labels is not None:
            stats["desirable"] = int(np.count_nonzero(self.labels))
            stats["undesirable"] = self.samples - stats["desirable"]
        stats.update(
            tokens=int(self.offsets[-1]),
            completion_tokens=int(np.count_nonzero(self.masks)) if len(self.masks) else 0,
            sequences_cut_at_seq_length=int(np.count_nonzero(lengths > self.seq_length + 1)),
            max_length=self.meta.get("max_length"),
            truncation_mode=self.meta.get("truncation_mode"),
        )
        for key in ("sequences_cut", "dropped_prompt_too_long", "identical_pairs"):
            if key in report:
                stats[f"preprocess_{key}"] = report[key]
        return stats

    def check_tokenizer(self, tokenizer_hash: str, vocab_size: int, field: str) -> None:
        protocol.check_tokenizer(self, tokenizer_hash, vocab_size, field)

    def state_dict(self) -> dict:
        return protocol.identity(self, FORMAT)


def open_preference(dl, split: str, seq_length: int, field: str) -> PreferenceDataset:
    if dl.packing:
        raise UserError(
            f"{field}.packing: preference pairs are read one per sample (TRL pads them): set packing: false"
        )
    return PreferenceDataset(dl.dataset_dir, split, seq_length, f"{field}.dataset_dir")


register_dataset_format("PreferenceDataset", open_preference)
