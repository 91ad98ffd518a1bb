"""Reading a packed dataset directory and ordering its samples.

Directory layout (written by `meshformer preprocess`, see `preprocess.py`):
    meta.json            {"format": "meshformer-packed-v1", "dtype": "uint16"|"uint32", "tokenizer_hash": sha256 of
                          tokenizer.json, "vocab_size", "eos_token_id", "splits": {"train": {"tokens", "documents"},
                          "validation": {...}}, "duplicates_removed", ...}
    tokenizer.json       the tokenizer the tokens were made with
    {split}.bin          all documents' tokens back to back, each followed by EOS (raw little-endian `dtype`)
    {split}.idx.npy      int64 start offset of every document in {split}.bin

A sample is a window of seq_length + 1 tokens (inputs and shifted labels); windows tile the stream with
stride seq_length, so packing crosses document boundaries like Megatron and MindSpore Transformers.

Sample order: epoch e visits the samples in the permutation drawn from (seed, e); the run's k-th sample is
a pure function of (seed, k), so a checkpoint only records how many global batches were consumed. Both classes
follow data/protocol.py (`sample(i)`, the tokenizer they were made with, `state_dict()`), as any format must;
data/registry.py opens them as data_loader.type MindDataset.
"""

from __future__ import annotations

import bisect
import json
import threading
from pathlib import Path

import numpy as np
import torch

from meshformer.data import protocol
from meshformer.data.preference_rows import mark_labels, rows_of_kto, rows_of_pairs
from meshformer.data.protocol import Sample
from meshformer.errors import UserError

FORMAT = "meshformer-packed-v1"
SFT_FORMAT = "meshformer-sft-v1"  # instruction data with a loss mask (data/sft.py)
PREFERENCE_FORMAT = "meshformer-preference-v1"  # pairs or KTO examples (data/preference.py)


def read_meta(dataset_dir: str | Path, field: str = "train_dataset.data_loader.dataset_dir") -> dict:
    d = Path(dataset_dir)
    if not str(dataset_dir):
        raise UserError(f"{field} is empty: set it to a directory made by `meshformer preprocess`")
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise UserError(
            f"{field}={str(d)!r} is not a meshformer dataset (no meta.json): "
            f"create it with `meshformer preprocess --input FILES --tokenizer DIR --output {d}`"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = getattr(e, "msg", None) or "not UTF-8"
        raise UserError(f"{meta_path}: corrupt meta.json ({why}): re-run `meshformer preprocess`") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path}: meta.json is a JSON {type(meta).__name__}, not an object: re-run preprocess")
    if meta.get("format") not in (FORMAT, SFT_FORMAT, PREFERENCE_FORMAT):
        raise UserError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}: re-run `meshformer preprocess`")
    splits, vocab = meta.get("splits"), meta.get("vocab_size")
    problem = (
        "dtype"
        if meta.get("dtype") not in ("uint16", "uint32")
        else "splits"
        if not isinstance(splits, dict)
        or not all(isinstance(v, dict) and isinstance(v.get("tokens"), int) for v in splits.values())
        else "vocab_size"
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1
        else None
    )
    if problem:
        raise UserError(f"{meta_path}: field {problem!r} is missing or malformed: re-run `meshformer preprocess`")
    return meta


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def map_array(path: Path, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    """`path` memory-mapped as `count` items of `dtype`, after checking that it holds exactly that many (a file
    cut short, padded or missing is one line; np.memmap would raise on an empty or odd-sized file)."""
    if not path.is_file():
        raise UserError(f"{path}: missing from the dataset: re-run `meshformer preprocess`")
    size, want = path.stat().st_size, count * dtype.itemsize
    if size != want:
        raise UserError(
            f"{path}: holds {size} bytes ({size / dtype.itemsize:g} {what}) but meta.json says {count} {what} "
            f"({want} bytes): the dataset is {'truncated' if size < want else 'damaged'}; re-run "
            f"`meshformer preprocess`"
        )
    return np.memmap(path, dtype=dtype, mode="r") if count else np.zeros(0, dtype=dtype)


def load_offsets(path: Path, samples: int, tokens: int) -> np.ndarray:
    """The n + 1 sample offsets of {split}.idx.npy, checked: 0 first, `tokens` last, never decreasing."""
    try:
        offsets = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UserError(f"{path}: missing from the dataset: re-run `meshformer preprocess`") from None
    except (ValueError, EOFError, OSError) as e:
        why = "it holds pickled objects, never loaded" if "pickle" in str(e) else str(e)
        raise UserError(f"{path}: not a readable .npy index ({why}): re-run `meshformer preprocess`") from None
    ok = (
        offsets.ndim == 1
        and offsets.dtype.kind in "iu"
        and offsets.shape[0] == samples + 1
        and int(offsets[0]) == 0
        and int(offsets[-1]) == tokens
        and bool(np.all(np.diff(offsets) >= 0))
    )
    if not ok:
        raise UserError(
            f"{path}: the sample index does not match meta.json ({samples} samples, {tokens} tokens): the dataset "
            f"is damaged; re-run `meshformer preprocess`"
        )
    return offsets.astype(np.int64)


def map_masked_split(directory: Path, meta: dict, split: str, field: str, what: tuple[str, str]):
    """(the split's entry in meta.json, its tokens, its loss mask) of a dataset of masked samples (SFT or preference:
    data/masked_output.py); `what`: (what the split holds, what to give preprocess more of), for the message when
    it holds none."""
    info = meta["splits"].get(split) or {}
    if not _is_int(info.get("samples")) or info["samples"] < 1:
        raise UserError(
            f"{field}={str(directory)!r} has no {split!r} {what[0]}: re-run `meshformer preprocess` with more "
            f"{what[1]} (or a larger --val-fraction for validation)"
        )
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    tokens = map_array(directory / f"{split}.bin", dtype, info["tokens"], "tokens")
    masks = map_array(directory / f"{split}.mask.bin", np.dtype(np.uint8), info["tokens"], "mask bytes")
    return info, tokens, masks


def pad_id(directory: Path, meta: dict) -> int:
    """The token a dataset's rows are padded with: its tokenizer's pad token, else its EOS."""
    pad = meta.get("pad_token_id") or meta.get("eos_token_id")
    if not _is_int(pad):
        raise UserError(f"{directory / 'meta.json'}: no integer pad_token_id or eos_token_id: re-run preprocess")
    return int(pad)


class PackedDataset:
    """Fixed-length samples over one split's memory-mapped token stream."""

    def __init__(
        self, dataset_dir: str | Path, split: str, seq_length: int, field: str = "train_dataset.data_loader.dataset_dir"
    ):
        self.dir = Path(dataset_dir)
        self.meta = read_meta(dataset_dir, field)
        self.split = split
        self.seq_length = seq_length
        info = self.meta.get("splits", {}).get(split)
        path = self.dir / f"{split}.bin"
        if not info or not path.is_file() or info.get("tokens", 0) == 0:
            raise UserError(
                f"{field}={str(self.dir)!r} has no {split!r} tokens: re-run `meshformer preprocess` "
                f"with more text (or a larger --val-fraction for validation)"
            )
        self.tokens = map_array(path, np.dtype(self.meta["dtype"]).newbyteorder("<"), info["tokens"], "tokens")
        self.num_samples = (self.tokens.shape[0] - 1) // seq_length
        if self.num_samples < 1:
            raise UserError(
                f"{field}={str(self.dir)!r}: the {split!r} split has {self.tokens.shape[0]} tokens, fewer "
                f"than seq_length+1={seq_length + 1}: lower model.model_config.seq_length or add text"
            )
        _tokenizer_of(self)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1].astype(np.int64)
        return torch.from_numpy(window)

    def sample(self, i: int) -> Sample:
        return Sample(self[i])

    def describe(self) -> dict:
        """`meshformer data stats`: the split's documents and tokens as preprocess counted them."""
        info = self.meta["splits"][self.split]
        used = self.num_samples * self.seq_length + 1
        return {"documents": info.get("documents"), "tokens": info["tokens"], "tokens_unused": info["tokens"] - used}

    def check_tokenizer(self, tokenizer_hash: str, vocab_size: int, field: str) -> None:
        protocol.check_tokenizer(self, tokenizer_hash, vocab_size, field)

    def state_dict(self) -> dict:
        return protocol.identity(self, self.meta["format"])


def _tokenizer_of(ds) -> None:
    """What a preprocessed dataset records of its tokenizer (data/protocol.py); a meta.json without a hash matches
    no tokenizer, so it is refused as a different one."""
    ds.tokenizer_hash = str(ds.meta.get("tokenizer_hash"))
    ds.vocab_size = ds.meta["vocab_size"]
    ds.tokenizer_file = ds.dir / "tokenizer.json"
    ds.source = str(ds.dir)


class SFTDataset:
    """Instruction samples (data/sft.py) as rows of seq_length + 1 tokens, with a mask of the tokens the loss counts
    (the assistant's; padding never). Longer samples are cut at seq_length + 1.

    Unpacked (default): one sample per row, padded with the pad id; causal attention already keeps every real token
    from seeing the padding after it. Packed (`packing`): samples are placed into rows best-fit-decreasing by length
    and `documents(i)` gives each position's sample index within the row, which the model turns into a
    block-diagonal causal mask and rotary positions restarting per sample: a packed sample computes exactly what it
    would alone, with a fraction of the padding.
    """

    def __init__(
        self,
        dataset_dir: str | Path,
        split: str,
        seq_length: int,
        field: str = "train_dataset.data_loader.dataset_dir",
        packing: bool = False,
    ):
        self.dir = Path(dataset_dir)
        self.meta = read_meta(dataset_dir, field)
        self.split, self.seq_length = split, seq_length
        what = ("samples", "conversations")
        info, self.tokens, self.masks = map_masked_split(self.dir, self.meta, split, field, what)
        self.offsets = load_offsets(self.dir / f"{split}.idx.npy", info["samples"], info["tokens"])
        self.pad = pad_id(self.dir, self.meta)
        self.packing = packing
        lengths = np.minimum(np.diff(self.offsets), seq_length + 1)
        self.rows = pack_rows(lengths, seq_length + 1) if packing else [[i] for i in range(len(lengths))]
        self.samples = len(lengths)
        self.padding = 1 - float(lengths.sum()) / (len(self.rows) * (seq_length + 1))  # share of row tokens
        _tokenizer_of(self)

    def __len__(self) -> int:
        return len(self.rows)

    def _row(self, data: np.ndarray, i: int, fill: int) -> torch.Tensor:
        row = np.full(self.seq_length + 1, fill, dtype=np.int64)
        n = 0
        for k in self.rows[i]:
            a = int(self.offsets[k])
            m = min(int(self.offsets[k + 1]) - a, self.seq_length + 1 - n)
            row[n : n + m] = data[a : a + m]
            n += m
        return torch.from_numpy(row)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._row(self.tokens, i, self.pad)

    def mask(self, i: int) -> torch.Tensor:
        return self._row(self.masks, i, 0).bool()

    def documents(self, i: int) -> torch.Tensor | None:
        """[seq_length + 1] sample index of every position of packed row i (the padding after them: one more);
        None when rows are not packed."""
        if not self.packing:
            return None
        lengths = [min(int(self.offsets[k + 1] - self.offsets[k]), self.seq_length + 1) for k in self.rows[i]]
        docs = np.full(self.seq_length + 1, len(lengths), dtype=np.int64)
        docs[: sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
        return torch.from_numpy(docs)

    def sample(self, i: int) -> Sample:
        return Sample(self[i], self.mask(i), self.documents(i))

    def describe(self) -> dict:
        """`meshformer data stats`: conversations, rows and the share of row tokens that are padding."""
        targets = int(np.count_nonzero(self.masks)) if len(self.masks) else 0
        return {
            "conversations": self.samples,
            "rows": len(self.rows),
            "packing": self.packing,
            "tokens": int(self.offsets[-1]),
            "target_tokens": targets,
            "padding": round(self.padding, 4),
        }

    check_tokenizer = PackedDataset.check_tokenizer
    state_dict = PackedDataset.state_dict


def pack_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most `capacity` tokens: best-fit decreasing (each sample, longest
    first, goes to the open row it fills most tightly), deterministic. Within a row samples keep file order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted: the tightest fit is the first entry >= length
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            space, r = free.pop(k)
        else:
            space, r = capacity, len(rows)
            rows.append([])
        rows[r].append(int(i))
        if space > n:
            bisect.insort(free, (space - n, r))
    return [sorted(r) for r in rows]


def open_dataset(dataset_dir: str | Path, split: str, seq_length: int, field: str, packing: bool = False):
    """The dataset class its meta.json names: packed text (pre-training) or instruction samples (fine-tuning);
    preference data (data/preference_dataset.py) is opened by data/registry.py before it comes here."""
    if read_meta(dataset_dir, field).get("format") == SFT_FORMAT:
        return SFTDataset(dataset_dir, split, seq_length, field, packing)
    if packing:
        packing_field = field.rsplit(".", 1)[0] + ".packing"
        raise UserError(
            f"{packing_field}=true applies to instruction data, but {dataset_dir} is text (already packed into "
            f"full windows): set packing: false, or preprocess instruction data (.jsonl conversations)"
        )
    return PackedDataset(dataset_dir, split, seq_length, field)


class SampleOrder:
    """The run's sample sequence: epoch e is a permutation drawn from (seed, e), or 0..n-1 without shuffle."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = num_samples, seed, shuffle
        self._epoch, self._perm = -1, None
        self._lock = threading.Lock()  # prefetching threads (data/prefetch.py) may ask for two epochs at once

    def epoch_order(self, epoch: int) -> torch.Tensor:
        with self._lock:
            if epoch != self._epoch:
                if self.shuffle:
                    g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                    self._perm = torch.randperm(self.n, generator=g)
                else:
                    self._perm = torch.arange(self.n)
                self._epoch = epoch
            return self._perm


class GlobalBatches:
    """Global batch b (counting from 0 over the whole run) -> this data-parallel rank's sample ids.

    Each epoch yields floor(n / global_batch) batches (drop_remainder). Rank r of `dp` reads the r-th contiguous
    slice of every global batch, so the samples per optimizer step are the same for every layout.
    """

    def __init__(self, order: SampleOrder, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        if global_batch % dp_size:
            raise ValueError("global batch must be divisible by the data-parallel size")
        self.order, self.gb, self.dp_rank, self.dp_size = order, global_batch, dp_rank, dp_size
        self.per_epoch = order.n // global_batch

    def sample_ids(self, b: int) -> torch.Tensor:
        epoch, k = divmod(b, self.per_epoch)
        ids = self.order.epoch_order(epoch)[k * self.gb : (k + 1) * self.gb]
        per_rank = self.gb // self.dp_size
        return ids[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def samples(self, dataset: protocol.Dataset, b: int) -> list[Sample]:
        return [dataset.sample(int(i)) for i in self.sample_ids(b)]

    def host_inputs(
        self, dataset: protocol.Dataset, b: int, vocab_size: int, ignore: int, field: str, rows: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inputs, next-token labels and document indices (packed rows; else None) of global batch b's rows, on
        the host, from `dataset.sample(i)` alone. Labels the loss mask does not keep (prompts, padding of
        instruction data) and labels that would predict the first token of the next packed sample become
        `ignore`. The token ids are checked against the vocabulary here, before any copy: on a GPU a check there
        would make the host wait for the device every step. `rows`: preference samples, read as two rows each
        (data/preference_rows.py: pairs, orpo or kto)."""
        samples = self.samples(dataset, b)
        if not rows:
            return batch_inputs(samples, vocab_size, ignore, f"{field}: global batch {b}")
        if rows == "kto":
            previous = [dataset.sample(int(i)) for i in self.previous_sample_ids(b)]
            as_rows = rows_of_kto(samples, previous, int(getattr(dataset, "pad", 0)))
        else:
            as_rows = rows_of_pairs(samples)
        inputs, labels, documents = batch_inputs(as_rows, vocab_size, ignore, f"{field}: global batch {b}")
        mark_labels(rows, as_rows, samples, labels, vocab_size)
        return inputs, labels, documents

    def previous_sample_ids(self, b: int) -> torch.Tensor:
        """For each of this rank's samples of global batch b, the sample before it in the global batch (the
        first's: the batch's last)."""
        epoch, k = divmod(b, self.per_epoch)
        ids = self.order.epoch_order(epoch)[k * self.gb : (k + 1) * self.gb].roll(1)
        per_rank = self.gb // self.dp_size
        return ids[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]

    def model_inputs(
        self, dataset: protocol.Dataset, b: int, device: torch.device, vocab_size: int, ignore: int, field: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`host_inputs` on `device`."""
        return to_device(self.host_inputs(dataset, b, vocab_size, ignore, field), device)


def batch_inputs(
    samples: list[Sample], vocab_size: int, ignore: int, where: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inputs, labels and documents of these rows (GlobalBatches.host_inputs says how); `where` opens the error of a
    token id outside the vocabulary."""
    tokens = torch.stack([s.tokens for s in samples])
    if int(tokens.max()) >= vocab_size:  # a corrupt or foreign token file
        raise UserError(
            f"{where} holds token id {int(tokens.max())} but model.model_config.vocab_size is "
            f"{vocab_size}: re-run `meshformer preprocess`"
        )
    labels = tokens[:, 1:]
    if samples[0].loss_mask is not None:
        targets = torch.stack([s.loss_mask for s in samples])
        labels = labels.masked_fill(~targets[:, 1:], ignore)
    documents = None
    if samples[0].documents is not None:
        documents = torch.stack([s.documents for s in samples])
        labels = labels.masked_fill(documents[:, 1:] != documents[:, :-1], ignore)
        documents = documents[:, :-1]
    return tokens[:, :-1], labels, documents


def pinned(batch: tuple) -> tuple:
    """The batch's tensors in page-locked host memory, so the copy to a GPU can run asynchronously."""
    return tuple(None if t is None else t.pin_memory() for t in batch)


def to_device(batch: tuple, device: torch.device) -> tuple:
    """The batch's tensors on `device`; from pinned memory the copy does not block the host."""
    non_blocking = device.type == "cuda"
    return tuple(None if t is None else t.to(device, non_blocking=non_blocking) for t in batch)
