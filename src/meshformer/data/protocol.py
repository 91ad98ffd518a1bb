"""What the trainer needs from a dataset format, whatever its files look like.

A dataset is `len(ds)` fixed-length samples and `ds.sample(i)`, a pure function of i; the sample order lives outside
it (data/dataset.py SampleOrder, GlobalBatches: a pure function of (seed, epoch) and the step), so resuming needs the
step, which the trainer keeps, and nothing from the dataset but proof that it is the same data. For most formats
`state_dict()` is therefore just `identity(ds, format)`: the format, the sample count and a fingerprint of a few
samples. A format with a position of its own (a stream) would also return that position and define
`load_state_dict(state)` to seek to it; without one, `check_same_data` compares the saved state with the new one.

A format that knows the tokenizer its tokens were made with sets `tokenizer_hash` (sha256 of tokenizer.json) and
`vocab_size`, so training refuses a different tokenizer or a smaller model vocabulary; `tokenizer_file` names the
tokenizer.json it carries, the default when the config names none. All three may be None (an in-memory format):
then the config's tokenizer, if any, is used unchecked, and without one the run trains and saves no tokenizer. A
format configured with token ids of its own (a Megatron blend's eod) may set `special_ids`, {dotted field: id},
checked to lie inside the vocabulary.

A format whose index order already is its training order (a Megatron blend: its own tool shuffled it) sets
`ordered = True`; the trainer then reads samples 0, 1, 2, ... unless `data_loader.shuffle` is set true.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from meshformer.errors import UserError

FINGERPRINT_SAMPLES = 16  # samples hashed, spread evenly over the dataset: cheap for any size, any format
TARGET_CHECK_SAMPLES = 64  # samples read, spread evenly, to find one that trains a target (check_trains_targets)


@dataclass(frozen=True)
class Sample:
    tokens: torch.Tensor  # int64 [seq_length + 1]: inputs and, shifted by one, next-token labels
    loss_mask: torch.Tensor | None = None  # bool, same length; True: the token is a target (None: all are)
    documents: torch.Tensor | None = None  # int64, same length: document index per position of a packed row


@dataclass(frozen=True)
class PreferenceSample(Sample):
    """A preference pair (data/preference_dataset.py): `tokens`/`loss_mask` are the chosen sequence and its
    completion mask, `rejected`/`rejected_mask` the rejected one; an unpaired (KTO) example has no rejected
    sequence and a `label` (True: desirable)."""

    rejected: torch.Tensor | None = None  # int64 [seq_length + 1]
    rejected_mask: torch.Tensor | None = None  # bool, same length: the rejected completion's tokens
    label: bool | None = None


@runtime_checkable
class Dataset(Protocol):
    tokenizer_hash: str | None
    vocab_size: int | None
    tokenizer_file: Path | None
    # optional: ordered (bool, default False), load_state_dict(state), describe() -> dict (`meshformer data stats`),
    # special_ids ({dotted field: token id}, check_tokenizer), source (str: its files, for errors)

    def __len__(self) -> int: ...

    def sample(self, i: int) -> Sample: ...

    def state_dict(self) -> dict: ...


def fingerprint(ds: Dataset) -> str:
    """sha256 over the sample count and FINGERPRINT_SAMPLES evenly spread samples (tokens, mask, documents)."""
    h = hashlib.sha256(str(len(ds)).encode())
    for i in spread(len(ds), FINGERPRINT_SAMPLES):
        s = ds.sample(i)
        for t in (s.tokens, s.loss_mask, s.documents, getattr(s, "rejected", None), getattr(s, "rejected_mask", None)):
            h.update(b"-" if t is None else t.to(torch.int64).numpy().tobytes())
        if getattr(s, "label", None) is not None:
            h.update(b"+" if s.label else b"0")
    return h.hexdigest()


def spread(n: int, count: int) -> list[int]:
    """Up to `count` sample ids spread evenly over 0 .. n - 1, first and last included."""
    return sorted({k * (n - 1) // max(count - 1, 1) for k in range(count)}) if n else []


def _trains_a_target(s: Sample) -> bool:
    """Whether any label of the sample counts in the loss (data/dataset.py batch_inputs' rule)."""
    targets = torch.ones(len(s.tokens) - 1, dtype=torch.bool) if s.loss_mask is None else s.loss_mask[1:]
    if s.documents is not None:
        targets = targets & (s.documents[1:] == s.documents[:-1])
    return bool(targets.any())


def check_trains_targets(ds: Dataset, field: str) -> None:
    """Refuse, before training, data whose samples train no target (every label ignored): each step's loss would be
    0/0, skipped as non-finite until the run stops. TARGET_CHECK_SAMPLES samples spread over the data are read (all
    of a smaller dataset); one with a target passes."""
    n = len(ds)
    ids = spread(n, TARGET_CHECK_SAMPLES)
    if not ids or any(_trains_a_target(ds.sample(i)) for i in ids):
        return
    which = f"all {n} samples" if len(ids) == n else f"{len(ids)} samples read, spread over its {n}"
    source = getattr(ds, "source", None)
    raise UserError(
        f"{field}{f' ({source})' if source else ''}: no target is trained: every label is ignored ({which}), so "
        f"every step's loss would be 0/0: check the labels (-100 only where the loss must not count), the loss "
        f"mask, or a seq_length that cuts the answers off"
    )


def shuffles(ds: Dataset, shuffle: bool | None) -> bool:
    """Whether the trainer shuffles `ds`: `data_loader.shuffle` when set, else unless the format keeps its own order."""
    return (not getattr(ds, "ordered", False)) if shuffle is None else shuffle


def identity(ds: Dataset, format_name: str) -> dict:
    """The resume state of a dataset whose samples depend on nothing but i: what it is, not where a run is."""
    return {"format": format_name, "samples": len(ds), "fingerprint": fingerprint(ds)}


def check_same_data(saved: dict, now: dict, field: str) -> None:
    """Refuse a resume whose data differs from the checkpoint's (keys missing from an older checkpoint pass)."""
    for key, value in saved.items():
        if key in now and now[key] != value:
            shown = (lambda v: str(v)[:12]) if key == "fingerprint" else json.dumps
            raise UserError(
                f"resume_training: {field} differs from the data the checkpoint was trained on ({key} "
                f"{shown(value)} then, {shown(now[key])} now): resume on the same data, or start a new run from "
                f"its weights with load_checkpoint (resume_training: false)"
            )


def check_tokenizer(ds: Dataset, tokenizer_hash: str | None, model_vocab_size: int, field: str) -> None:
    """The dataset's tokens must come from this tokenizer and fit the model's vocabulary (unknowns pass)."""
    if ds.tokenizer_hash is not None and tokenizer_hash is not None and ds.tokenizer_hash != tokenizer_hash:
        raise UserError(
            f"{field}: the dataset was tokenized with a different tokenizer (hash "
            f"{ds.tokenizer_hash[:12]} vs {tokenizer_hash[:12]}): "
            f"re-run `meshformer preprocess` with the same tokenizer"
        )
    if ds.vocab_size is not None and ds.vocab_size > model_vocab_size:
        raise UserError(
            f"model.model_config.vocab_size={model_vocab_size} is smaller than the dataset's tokenizer "
            f"vocabulary ({ds.vocab_size}): set vocab_size >= {ds.vocab_size}"
        )
    vocab = min(model_vocab_size, ds.vocab_size or model_vocab_size)
    for name, token in getattr(ds, "special_ids", {}).items():
        if token >= vocab:  # no token equals it: its masks would silently never apply
            raise UserError(
                f"{name}={token} is outside the vocabulary ({vocab} ids: 0 to {vocab - 1}): set it to the id the "
                f"data's tokenizer gives that token"
            )
