"""One Megatron GPTDataset: the samples megatron-core 0.16.1 cuts from one split of one indexed file, in its order.

Megatron's order of operations (gpt_dataset.py `_build_document_sample_shuffle_indices`), reproduced step by step
with the same numpy RandomState, so every sample is the one Megatron's `GPTDataset[i]` returns:
1. the split's sequences are `[round(lo * n), round(hi * n))` of the file's n sequences (the split matrix);
2. enough epochs to give `num_samples` samples of seq_length (+1) tokens; the last epoch is shuffled on its own
   (`separate_final_epoch`) when it contributes fewer than 80% of an epoch's samples;
3. the document index: the split's sequence ids repeated once per epoch, shuffled by RandomState(seed);
4. the sample index (helpers.cpp build_sample_idx): the shuffled sequences read as one token stream, sample k its
   tokens [k * seq_length, (k + 1) * seq_length + 1) (the extra token overlaps the next sample), the last
   partial sample dropped, or, for validation with drop_last_partial_validation_sequence false, padded;
5. the shuffle index: a permutation of the samples from the same RandomState (the last epoch's on its own).
Here step 4 is a cumulative sum and a binary search instead of a walk over every document, so a file of millions
of documents builds in a second or two.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshformer.data.megatron.indexed import IndexedFile
from meshformer.errors import UserError

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # Megatron's: a last epoch giving fewer samples than this is shuffled apart


@dataclass(frozen=True)
class GPTSettings:
    """The GPTDatasetConfig fields that decide which tokens a sample holds."""

    seed: int
    seq_length: int
    add_extra_token: bool = True
    drop_last_partial_validation: bool = True


def split_range(split: tuple[float, float], num_sequences: int) -> tuple[int, int]:
    """The sequences of one split-matrix entry, rounded as Megatron rounds them."""
    return int(round(split[0] * float(num_sequences))), int(round(split[1] * float(num_sequences)))


class GPTSplit:
    """Megatron's GPTDataset over sequences [begin, end) of `file`: `len`, `text(i)` (seq_length + extra tokens,
    int64, padded with `pad` where the data ran out) and the figures `describe` reports."""

    def __init__(
        self,
        file: IndexedFile,
        begin: int,
        end: int,
        num_samples: int | None,
        settings: GPTSettings,
        validation: bool,
        pad: int,
        where: str,
    ):
        self.file, self.settings, self.pad = file, settings, pad
        self.num_requested = num_samples
        extra, seq = int(settings.add_extra_token), settings.seq_length
        self.extra, self.seq = extra, seq
        documents = np.arange(begin, end, dtype=np.int32)
        self.tokens_per_epoch = int(file.sequence_lengths[begin:end].sum(dtype=np.int64))
        if self.tokens_per_epoch <= extra:
            raise UserError(
                f"{where}: {file.prefix} has {self.tokens_per_epoch} tokens in this split (sequences {begin} to "
                f"{end}): too few for one sample; give this split a larger share or use other data"
            )
        self.num_epochs = _num_epochs(self.tokens_per_epoch, num_samples, seq, extra)
        separate, sans_final = self._separate_final_epoch(num_samples)
        rng = np.random.RandomState(settings.seed)
        self.document_index = _document_index(documents, self.num_epochs, rng, separate)
        drop_last = not (validation and not settings.drop_last_partial_validation)
        self.total_tokens = self.num_epochs * self.tokens_per_epoch
        self.num_samples = sample_count(self.total_tokens, seq, extra, drop_last)
        first = sans_final if separate else self.num_samples
        self.shuffle_index = _shuffle_index(first, self.num_samples, rng)
        all_lengths = file.sequence_lengths
        if len(self.document_index) * 2 > len(all_lengths):  # random reads of most of it: from memory, not the map
            all_lengths = np.array(all_lengths)
        lengths = all_lengths[self.document_index].astype(np.int64)
        self.starts = np.zeros(len(lengths) + 1, np.int64)  # token offset of each document-index entry
        np.cumsum(lengths, out=self.starts[1:])

    def _separate_final_epoch(self, num_samples: int | None) -> tuple[bool, int]:
        if self.num_epochs == 1:
            return False, 0
        tpe, extra, seq = self.tokens_per_epoch, self.extra, self.seq
        sans_final = ((self.num_epochs - 1) * tpe - extra) // seq
        from_final = num_samples - sans_final
        per_epoch = (tpe - extra) // seq
        return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), sans_final

    def __len__(self) -> int:
        return self.num_samples

    def text(self, i: int) -> np.ndarray:
        """Megatron's `_query_document_sample_shuffle_indices(i)`: seq_length + extra tokens, padded with pad."""
        k = int(self.shuffle_index[i])
        begin = k * self.seq
        end = min((k + 1) * self.seq, self.total_tokens - self.extra) + self.extra
        first = int(np.searchsorted(self.starts, begin, side="right")) - 1
        last = int(np.searchsorted(self.starts, end, side="left"))
        lo = np.maximum(self.starts[first:last], begin)  # the sample's piece of each document, in stream offsets
        hi = np.minimum(self.starts[first + 1 : last + 1], end)
        docs = self.document_index[first:last]
        got = self.file.gather(docs, lo - self.starts[first:last], hi - lo)
        out = np.full(self.seq + self.extra, self.pad, np.int64)
        out[: len(got)] = got
        return out


def _num_epochs(tokens_per_epoch: int, num_samples: int | None, seq: int, extra: int) -> int:
    """The fewest epochs holding num_samples samples (GPTDataset._get_num_epochs); one when no count is asked."""
    if num_samples is None:
        return 1
    return max(1, -(-(num_samples * seq + extra) // tokens_per_epoch))


def build_bytes(tokens_per_epoch: int, documents: int, num_samples: int | None, seq: int, extra: int) -> int:
    """About the host memory GPTSplit takes at its peak for these figures, worked out before allocating any of it:
    per document-index entry its int32 id, its int32 and int64 lengths and its int64 start; per sample the shuffle
    index and its concatenated copy."""
    if tokens_per_epoch <= extra:
        return 0  # GPTSplit refuses it
    epochs = _num_epochs(tokens_per_epoch, num_samples, seq, extra)
    samples = epochs * tokens_per_epoch // seq + 1
    return documents * epochs * 24 + samples * 16


def sample_count(total_tokens: int, seq: int, extra: int, drop_last: bool) -> int:
    """build_sample_idx's sample count; the partial-sample case divides in single precision, as helpers.cpp does."""
    if drop_last:
        return (total_tokens - extra) // seq
    return int(np.ceil(np.float32(np.float32(total_tokens - extra) / np.float32(seq))))


def _document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """gpt_dataset._build_document_index: the documents once per epoch, shuffled (the last epoch apart)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents, num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = _document_index(documents, num_epochs - 1, rng, False)
    last = _document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def _shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """gpt_dataset._build_shuffle_index: [0, num_first) shuffled, then [num_first, total) shuffled."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))
