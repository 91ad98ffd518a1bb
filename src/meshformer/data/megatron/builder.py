"""One split (train or validation) of a MindSpore Transformers / Megatron blend config, built as
BlendedMegatronDatasetBuilder builds it: which GPTDatasets, of how many samples each, and the blend over them."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshformer.data.megatron import blend
from meshformer.data.megatron.gpt_dataset import GPTSettings, GPTSplit, build_bytes, sample_count, split_range
from meshformer.data.megatron.indexed import IndexedFile
from meshformer.errors import UserError


@dataclass(frozen=True)
class SplitRequest:
    """What to build: the split's index (0 train, 1 validation), the samples asked (None: one epoch), the GPT
    settings, the pad id, the builder threads and the config's dotted name for errors."""

    index: int
    size: int | None
    settings: GPTSettings
    pad: int
    threads: int
    field: str


class BlendedSplit:
    """A split's samples in Megatron's order: `len`, `text(i)`; `datasets` and the blend's `dataset_index`
    (None for a single GPTDataset, read directly)."""

    def __init__(self, datasets: list[GPTSplit], weights: list[float] | None, indices=None):
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.dataset_sample_index = indices if indices is not None else (None, None)

    def __len__(self) -> int:
        return len(self.datasets[0]) if self.dataset_index is None else len(self.dataset_index)

    def text(self, i: int) -> np.ndarray:
        if self.dataset_index is None:
            return self.datasets[0].text(i)
        return self.datasets[int(self.dataset_index[i])].text(int(self.dataset_sample_index[i]))

    def samples_per_dataset(self) -> list[int]:
        if self.dataset_index is None:
            return [len(self)]
        return np.bincount(self.dataset_index, minlength=len(self.datasets)).tolist()


def build_split(cfg, req: SplitRequest) -> BlendedSplit:
    """cfg: MegatronBlendConfig. data_path + split, or the split's own <split>_data_path (blend_per_split)."""
    per_split = [cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path]
    name = blend.SPLITS[req.index]
    if any(per_split):
        if cfg.data_path or cfg.split:
            raise UserError(
                f"{req.field}.data_path/split and train_data_path/valid_data_path/test_data_path are exclusive "
                f"(Megatron's blend and blend_per_split): set one of them"
            )
        key = ("train_data_path", "valid_data_path", "test_data_path")[req.index]
        spec = blend.parse_blend(per_split[req.index], f"{req.field}.{key}")
        if spec is None:
            raise UserError(f"{req.field}.{key} is empty: the {name} split needs its weight/prefix list")
        bounds, where = (0.0, 1.0), f"{req.field}.{key}"
        direct = len(spec.prefixes) == 1
    else:
        spec = blend.parse_blend(cfg.data_path, f"{req.field}.data_path")
        if spec is None:
            raise UserError(f"{req.field}.data_path is empty: give weight/prefix pairs of Megatron .bin/.idx datasets")
        if cfg.split is None:
            raise UserError(f"{req.field}.split is not set: give the train/validation/test shares, e.g. '99,1,0'")
        bounds = blend.split_matrix(cfg.split, f"{req.field}.split")[req.index]
        if bounds is None:
            raise UserError(
                f"{req.field}.split={cfg.split!r} gives the {name} split no share: e.g. '99,1,0' keeps 1% for it"
            )
        direct, where = len(spec.prefixes) == 1 and spec.weights is None, f"{req.field}.data_path"
    files = _open_files(spec, where)
    if direct:
        _check_memory(files, [req.size], 0, bounds, req)
        return BlendedSplit([_gpt_split(files[0], bounds, req.size, req)], None)
    return _blend(files, spec, bounds, req)


def _open_files(spec: blend.BlendSpec, where: str) -> list[IndexedFile]:
    files = []
    for prefix in spec.prefixes:
        try:
            files.append(IndexedFile(prefix))
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
    return files


def _gpt_split(file: IndexedFile, bounds: tuple[float, float], size: int | None, req: SplitRequest) -> GPTSplit:
    begin, end = split_range(bounds, len(file))
    return GPTSplit(file, begin, end, size, req.settings, req.index == 1, req.pad, f"{req.field}.data_path")


def _epoch_samples(file: IndexedFile, bounds: tuple[float, float], req: SplitRequest) -> int:
    begin, end = split_range(bounds, len(file))
    tokens = int(file.sequence_lengths[begin:end].sum(dtype=np.int64))
    s = req.settings
    drop_last = not (req.index == 1 and not s.drop_last_partial_validation)
    return max(sample_count(tokens, s.seq_length, int(s.add_extra_token), drop_last), 0)


def _blend(files: list[IndexedFile], spec: blend.BlendSpec, bounds, req: SplitRequest) -> BlendedSplit:
    if spec.weights is None:
        asked = [None] * len(files)
    else:
        weights = blend.normalize(spec.weights)
        # No size asked (or 0): as many samples as one epoch of every dataset, drawn by the weights.
        size = req.size or sum(_epoch_samples(f, bounds, req) for f in files)
        target = blend.sizes_per_dataset(weights, size)
        asked = blend.sizes_per_dataset(weights, size, blend.MID_LEVEL_SURPLUS)
    blended = sum(_epoch_samples(f, bounds, req) for f in files) if spec.weights is None else sum(target)
    _check_memory(files, asked, blended, bounds, req)
    with ThreadPoolExecutor(max_workers=req.threads) as pool:
        datasets = list(pool.map(lambda fa: _gpt_split(fa[0], bounds, fa[1], req), zip(files, asked)))
    for f, ds in zip(files, datasets):
        if len(ds) == 0:
            raise UserError(
                f"{req.field}.data_path: {f.prefix} gives the {blend.SPLITS[req.index]} split no sample of "
                f"seq_length {req.settings.seq_length}: give it a larger share or drop it from the blend"
            )
    if spec.weights is None:
        lengths = [len(ds) for ds in datasets]
        if req.size is None:
            return BlendedSplit(datasets, blend.normalize(lengths), blend.exhaustive_blending_indices(lengths))
        weights, size = blend.normalize(lengths), min(req.size, sum(lengths))
    else:
        weights, size = blend.normalize(weights), sum(target)  # BlendedDataset normalises them once more
    indices = blend.blending_indices(weights, size)
    _check_not_oversampled(datasets, indices[0], req)
    return BlendedSplit(datasets, weights, indices)


def _check_memory(files: list[IndexedFile], asked: list, blended: int, bounds, req: SplitRequest) -> None:
    """Refuse, in a second and before allocating anything, a split whose indices would not fit in the host's
    memory: sizes of hundreds of millions of samples repeat a small dataset for millions of epochs, and the blend
    index holds every sample."""
    s = req.settings
    need = blended * blend.BYTES_PER_BLENDED_SAMPLE
    for f, n in zip(files, asked):
        begin, end = split_range(bounds, len(f))
        tokens = int(f.sequence_lengths[begin:end].sum(dtype=np.int64))
        need += build_bytes(tokens, end - begin, n, s.seq_length, int(s.add_extra_token))
    have = _host_memory_bytes()
    if have is None or need <= have:
        return
    field = f"{req.field.removesuffix('.config')}.sizes[{req.index}]"
    fewer = f"give at most about {req.size * have // need:,} samples" if req.size else "use a smaller dataset"
    raise UserError(
        f"{field}={req.size}: the {blend.SPLITS[req.index]} split's sample and blend indices would take about "
        f"{need / 2**30:,.1f} GiB ({need:,} bytes), more than the {have / 2**30:,.1f} GiB of memory available: "
        f"{fewer} (a typo?)"
    )


def _host_memory_bytes() -> int | None:
    """The host memory available now (MemAvailable), else the machine's total; None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_not_oversampled(datasets: list[GPTSplit], dataset_index: np.ndarray, req: SplitRequest) -> None:
    counts = np.bincount(dataset_index, minlength=len(datasets))
    for ds, n in zip(datasets, counts):
        if n > len(ds):
            raise UserError(
                f"{req.field}.data_path: the blend asks {int(n)} samples of {ds.file.prefix}, more than the "
                f"{len(ds)} built (Megatron's 0.5% surplus is too small for these weights): change sizes slightly"
            )
