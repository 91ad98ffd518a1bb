"""Megatron blends: weight/prefix lists, the split matrix, per-dataset sizes and the BlendedDataset sample order.

As megatron-core 0.16.1's BlendedMegatronDatasetBuilder builds a split: weights are normalised; a weighted blend of
`size` samples asks dataset d for ceil(ceil(size * w_d) * 1.005) samples (the 0.5% surplus) and is
sum_d ceil(size * w_d) samples long; sample i comes from the dataset d maximising w_d * max(i, 1) - count_d
(helpers.cpp build_blending_indices; the lowest d on ties) and is that dataset's count_d-th sample. A blend without
weights takes one epoch of every dataset, in proportion to their sizes (build_exhaustive_blending_indices); a
single prefix without a weight is one GPTDataset of `size` samples, no blend.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from meshformer.errors import UserError

SPLITS = ("train", "validation", "test")
MID_LEVEL_SURPLUS = 0.005  # BlendedMegatronDatasetConfig.mid_level_dataset_surplus
# blending_indices' peak per sample: the list of choices (8), the int16 index (2), the int64 sample index (8) and
# _running_counts' int64 positions and numbering of one dataset (16)
BYTES_PER_BLENDED_SAMPLE = 34


@dataclass(frozen=True)
class BlendSpec:
    """Dataset prefixes and their weights as written (None: no weights, Megatron's blend by dataset size)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value))
    except ValueError:
        return None


def parse_blend(entries: list, field: str) -> BlendSpec | None:
    """`['0.3', prefix_a, '0.7', prefix_b]`, or prefixes alone (get_blend_from_list), checked; None when empty."""
    if isinstance(entries, str):  # Megatron-LM's command-line form: "0.3 /data/a 0.7 /data/b"
        entries = entries.split()
    if not entries:
        return None
    fix = "write weight/prefix pairs, e.g. ['0.3', /data/a_text_document, '0.7', /data/b_text_document]"
    numbers = [_number(e) for e in entries]
    if len(entries) % 2 == 0 and all(n is not None for n in numbers[0::2]):
        weights, prefixes = numbers[0::2], entries[1::2]
    elif all(n is None for n in numbers):
        weights, prefixes = None, entries
    elif len(entries) % 2:
        raise UserError(f"{field}: {len(entries)} entries, an odd number, with weights among them: {fix}")
    else:
        raise UserError(f"{field}: a weight is not a number (entries {entries[0::2]!r} should be): {fix}")
    for p in prefixes:
        if not isinstance(p, str) or _number(p) is not None:
            raise UserError(f"{field}: {p!r} is not a dataset prefix (a weight where a path belongs?): {fix}")
        if "://" in p:
            raise UserError(f"{field}: {p!r}: only local files are read; copy the dataset to a local disk")
    if weights is not None:
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise UserError(f"{field}: weights {weights} must be positive numbers (drop a dataset instead of 0)")
    prefixes = tuple(p.strip() for p in prefixes)
    seen: dict[str, str] = {}
    for p in prefixes:
        key = os.path.realpath(p)
        if key in seen:  # Megatron would build it twice with one seed: every sample of it drawn twice
            also = "" if seen[key] == p else f" (as {seen[key]!r})"
            raise UserError(f"{field}: {p!r} is listed twice{also}: list each dataset once (add up its weights)")
        seen[key] = p
    return BlendSpec(prefixes, None if weights is None else tuple(weights))


def normalize(weights) -> list[float]:
    """utils.normalize: w / sum(w) in float64, as Python floats."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(split: str | None, field: str) -> list[tuple[float, float] | None]:
    """`"99,1,0"` -> [(0, 0.99), (0.99, 1.0), None]: Megatron's parse_and_normalize_split and
    convert_split_vector_to_split_matrix."""
    fix = "give the train, validation and test shares of every dataset, e.g. '99,1,0'"
    text = "" if split is None else str(split)
    # Megatron reads every run of digits and dots and skips the rest, so "1,nan,0" or "-1,2,0" would silently be
    # other shares than written: only numbers and separators are read here.
    stray = re.sub(r"[.0-9]+|[\s,:/]", "", text)
    if stray:
        raise UserError(f"{field}={split!r}: {stray!r} is not a share (shares are numbers >= 0): {fix}")
    try:
        shares = [float(s) for s in re.findall(r"[.0-9]+", text)]
    except ValueError:
        raise UserError(f"{field}={split!r}: {fix}") from None
    if not shares or len(shares) > len(SPLITS) or sum(shares) <= 0:
        raise UserError(f"{field}={split!r}: {fix}")
    vector = normalize(shares + [0.0] * (len(SPLITS) - len(shares)))
    ends = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector])
    return [(lo, hi) if hi > lo else None for lo, hi in zip(ends[:-1], ends[1:])]


def sizes_per_dataset(weights: list[float], size: int, surplus: float = 0.0) -> list[int]:
    """_get_size_per_split_per_dataset for one split: ceil(ceil(size * w) * (1 + surplus)) per dataset."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """helpers.cpp build_blending_indices: (dataset of each sample int16, its sample within that dataset int64).
    The choice of each sample depends on every earlier one, so this is a loop; it records only the choice and
    numbers each dataset's samples afterwards, vectorised."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    chosen = [0] * size
    others = range(1, len(w))
    for i in range(size):
        x = float(i) if i > 1 else 1.0
        best, best_error = 0, w[0] * x - counts[0]
        for d in others:
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen[i] = best
        counts[best] += 1
    index = np.array(chosen, dtype=np.int16)
    return index, _running_counts(index, len(w))


def exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """helpers.cpp build_exhaustive_blending_indices: exactly sizes[d] samples of dataset d, in proportion."""
    total = sum(sizes)
    w = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = list(range(len(sizes)))  # every size is positive (the caller refuses empty datasets)
    chosen = [0] * total
    for i in range(total):
        x = max(float(i), 1.0)
        best, best_error = -1, -math.inf
        for d in unspent:
            error = w[d] * x - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen[i] = best
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    index = np.array(chosen, dtype=np.int16)
    return index, _running_counts(index, len(sizes))


def _running_counts(index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each sample, how many earlier samples came from its dataset."""
    out = np.zeros(len(index), np.int64)
    for d in range(num_datasets):
        where = np.flatnonzero(index == d)
        out[where] = np.arange(len(where))
    return out
