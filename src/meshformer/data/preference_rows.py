"""Preference samples as the rows a preference step reads (train/preference_step.py), two per sample:

  - pairs (dpo, simpo, orpo): the chosen sequence, then the rejected one;
  - kto: the example's own sequence, then its KL sequence: the example's prompt followed by the completion of the
    example before it in the global batch (the first takes the last's): TRL 1.16 KTOTrainer's mismatched pairs,
    (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), built over the whole global batch so every layout and accumulation
    split sees the same ones.

What a step needs beyond the completion's labels travels IN the labels, as label + vocab_size ("marked" labels:
every consumer of labels sees the same rows cut the same way, context parallelism included), and the step takes
the marks off (`unmark`):
  - orpo: the chosen row's prompt tokens are marked, since ORPO's NLL term covers the prompt as TRL computes it;
  - kto: the completion labels of an undesirable example's own row are marked (its label: False).
"""

from __future__ import annotations

import torch

from meshformer.data.protocol import Sample

ROW_KINDS = ("pairs", "orpo", "kto")


def rows_of_pairs(samples: list[Sample]) -> list[Sample]:
    """Preference pairs as rows, each pair's chosen then its rejected (adjacent, so no micro-batch split cuts a
    pair)."""
    return [row for s in samples for row in (Sample(s.tokens, s.loss_mask), Sample(s.rejected, s.rejected_mask))]


def kl_row(own: Sample, previous: Sample, pad: int) -> Sample:
    """own's prompt followed by previous's completion, cut to the row's length as TRL's collator cuts at
    max_length (keep the start), padded with `pad` (mask 0)."""
    width = own.tokens.shape[0]
    prompt = own.tokens[: _completion_start(own.loss_mask)]
    completion = previous.tokens[previous.loss_mask]
    tokens = torch.cat((prompt, completion))[:width]
    mask = torch.cat((torch.zeros(len(prompt), dtype=torch.bool), torch.ones(len(completion), dtype=torch.bool)))
    row = torch.full((width,), pad, dtype=torch.int64)
    row[: len(tokens)] = tokens
    row_mask = torch.zeros(width, dtype=torch.bool)
    row_mask[: len(tokens)] = mask[:width]
    return Sample(row, row_mask)


def _completion_start(mask: torch.Tensor) -> int:
    hits = mask.nonzero()
    return int(hits[0]) if len(hits) else int(mask.shape[0])


def rows_of_kto(samples: list[Sample], previous: list[Sample], pad: int) -> list[Sample]:
    """KTO examples as rows: each example's own sequence, then its KL sequence (`previous[i]` is the example before
    samples[i] in the global batch)."""
    return [row for s, p in zip(samples, previous) for row in (Sample(s.tokens, s.loss_mask), kl_row(s, p, pad))]


def mark_labels(kind: str, rows: list[Sample], samples: list[Sample], labels: torch.Tensor, vocab: int) -> None:
    """Mark (in place) what the step needs beyond the completion's labels of these rows (the module says what)."""
    own = rows[0::2]
    mask = torch.stack([r.loss_mask for r in own])[:, 1:]
    if kind == "orpo":  # the prompt: before the first completion token of a row that has one
        tokens = torch.stack([r.tokens for r in own])[:, 1:]
        prompt = (mask.cumsum(-1) == 0) & mask.any(-1, keepdim=True)
        labels[0::2] = torch.where(prompt, tokens + vocab, labels[0::2])
    elif kind == "kto":
        undesirable = torch.tensor([not s.label for s in samples])
        labels[0::2] = torch.where(undesirable[:, None] & mask, labels[0::2] + vocab, labels[0::2])


def unmark(labels: torch.Tensor, vocab: int, ignore: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels without the marked positions, the marked positions' token ids; `ignore` elsewhere)."""
    marked = labels >= vocab
    return labels.masked_fill(marked, ignore), torch.where(marked, labels - vocab, ignore)
