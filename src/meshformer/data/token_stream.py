"""Documents -> tokenization units -> batches -> token ids, in input order, encoded in the main process or by worker
processes, with a bounded amount of text in flight.

A unit is a whole document, or a piece of a long one (over PIECE_CHARS characters) cut just after a newline
that has text on both sides: the pre-tokenizers `cut_safe` accepts always split there, and BPE never merges across a
pre-token boundary, so the ids of the pieces, concatenated, are the ids of the whole document. A tokenizer that
is not cut-safe (a normalizer, a Metaspace pre-tokenizer, added tokens holding a newline) gets whole documents.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

PIECE_CHARS = 1 << 20  # a document longer than this is encoded in pieces of about this size
ENCODE_CHARS = 1 << 20  # characters per encode_batch_fast call inside a worker (bounds its Encoding objects)
IN_FLIGHT_PER_WORKER = 2  # batches sent ahead of the one being written, per worker

# Pre-tokenizer regexes (Llama 3, Qwen2) that never join "\n" to the non-blank text after it.
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_SPACES = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SAFE_SPLIT_PATTERNS = {_LETTERS + digits + _SPACES for digits in (r"\p{N}{1,3}", r"\p{N}")}


@dataclass
class Unit:
    """Text to encode, the document's split decision, and whether it starts / ends its document."""

    text: str
    decision: int
    first: bool
    last: bool


def _splits_at_newlines(pre: dict | None) -> bool:
    """Whether this pre-tokenizer splits between "\\n" and non-blank text whatever surrounds them, and acts on each
    piece alone (no prefix added at a piece's start)."""
    if not isinstance(pre, dict):
        return False
    kind = pre.get("type")
    if kind == "ByteLevel":
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space", False)
    if kind in ("Whitespace", "WhitespaceSplit"):
        return True
    if kind == "Split":
        return pre.get("behavior") == "Isolated" and (pre.get("pattern") or {}).get("Regex") in _SAFE_SPLIT_PATTERNS
    if kind == "Sequence":
        parts = pre.get("pretokenizers") or []
        harmless = all(_splits_at_newlines(p) or _per_piece(p) for p in parts)
        return harmless and any(_splits_at_newlines(p) for p in parts)
    return False


def _per_piece(pre: dict) -> bool:
    """Pre-tokenizers that only split further or map bytes, never adding text at a piece's start."""
    if pre.get("type") == "ByteLevel":
        return not pre.get("add_prefix_space", False)
    return pre.get("type") in ("Digits", "Punctuation")


def cut_safe(tok) -> bool:
    """Whether a document may be encoded in pieces cut after a newline between non-blank text (module docstring)."""
    spec = json.loads(tok.to_str())
    if spec.get("normalizer") is not None:
        return False
    if any("\n" in t.get("content", "") for t in spec.get("added_tokens", []) if not t.get("special")):
        return False
    return _splits_at_newlines(spec.get("pre_tokenizer"))


def safe_cut(text: str) -> int:
    """The end of the last piece of `text` that may be encoded alone: just after its last "\\n" that has
    non-blank text on both sides; 0 if there is none."""
    end = len(text) - 1
    while (i := text.rfind("\n", 1, end)) > 0:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i + 1
        end = i
    return 0


def document_units(pieces: Iterable[str], decision: int, cut: bool, piece_chars: int | None = None) -> Iterator[Unit]:
    """One document's units: its text whole, or (cut) in pieces of about piece_chars (PIECE_CHARS) cut where
    `safe_cut` says."""
    piece_chars = piece_chars or PIECE_CHARS
    buf, first = "", True
    for piece in pieces:
        buf += piece
        while cut and len(buf) >= piece_chars and (at := safe_cut(buf)):
            yield Unit(buf[:at], decision, first, False)
            buf, first = buf[at:], False
    yield Unit(buf, decision, first, True)


def batches(units: Iterable[Unit], max_units: int, max_chars: int) -> Iterator[list[Unit]]:
    """Units grouped for one encode call: at most max_units, and no more characters than max_chars past the one
    that reaches it."""
    batch, chars = [], 0
    for u in units:
        batch.append(u)
        chars += len(u.text)
        if len(batch) >= max_units or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------- encoding (this process or workers)

_worker_tok = None
_worker_dtype = None


def prepare_tokenizer(tok) -> None:
    """Raw packing: no padding or truncation, and special-token text stays text (a literal "<|endoftext|>" in a
    document must not become a real EOS)."""
    tok.no_padding()
    tok.no_truncation()
    tok.encode_special_tokens = True


def encode_texts(tok, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(every text's ids concatenated, as dtype; each text's length), encoding ENCODE_CHARS at a time."""
    ids, lengths, start = [], [], 0
    while start < len(texts):
        end, chars = start, 0
        while end < len(texts) and (end == start or chars + len(texts[end]) <= ENCODE_CHARS):
            chars += len(texts[end])
            end += 1
        for enc in tok.encode_batch_fast(texts[start:end], add_special_tokens=False):
            ids.append(np.asarray(enc.ids, dtype=dtype))
            lengths.append(len(enc.ids))
        start = end
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=dtype)
    return flat, np.asarray(lengths, dtype=np.int64)


def _init_worker(tok_json: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the processes are the parallelism
    from tokenizers import Tokenizer

    global _worker_tok, _worker_dtype
    _worker_tok = Tokenizer.from_str(tok_json)
    prepare_tokenizer(_worker_tok)
    _worker_dtype = np.dtype(dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_texts(_worker_tok, texts, _worker_dtype)


class Encoder:
    """Encodes batches of units in order: in this process (workers=0; the tokenizer's own threads) or in `workers`
    processes with one thread each, keeping IN_FLIGHT_PER_WORKER batches per worker queued."""

    def __init__(self, tok, dtype: np.dtype, workers: int):
        self.tok, self.dtype, self.workers, self.pool = tok, np.dtype(dtype), workers, None
        if workers > 0:
            import multiprocessing

            # spawn: a forked child would inherit the parent's tokenizer thread pool state (and torch, in tests)
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok.to_str(), self.dtype.str))

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def encode(self, batch_iter: Iterable[list[Unit]]) -> Iterator[tuple[list[Unit], list[np.ndarray]]]:
        """(batch, each unit's ids) for every batch, in order."""
        if self.pool is None:
            for batch in batch_iter:
                yield batch, _split(*encode_texts(self.tok, [u.text for u in batch], self.dtype))
            return
        pending: deque = deque()
        for batch in batch_iter:
            pending.append((batch, self.pool.apply_async(_encode_in_worker, ([u.text for u in batch],))))
            if len(pending) >= self.workers * IN_FLIGHT_PER_WORKER:
                done, result = pending.popleft()
                yield done, _split(*result.get())
        while pending:
            done, result = pending.popleft()
            yield done, _split(*result.get())


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
