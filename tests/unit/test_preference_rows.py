"""data/preference_rows.py: how preference samples become the step's rows. A KTO example's KL row is its prompt with
the completion of the example before it in the GLOBAL batch (TRL 1.16's rotation by one), whichever data-parallel
rank reads it; ORPO's chosen prompt and KTO's undesirable completions travel as marked labels, and unmark gives
back exactly the labels and the token ids."""

from __future__ import annotations

import torch

from meshformer.data.dataset import GlobalBatches, SampleOrder
from meshformer.data.preference_rows import kl_row, unmark
from meshformer.data.protocol import PreferenceSample

VOCAB, IGNORE, PAD, WIDTH = 100, -100, 0, 10


def _example(prompt: list[int], completion: list[int], label: bool) -> PreferenceSample:
    tokens = torch.full((WIDTH,), PAD, dtype=torch.int64)
    mask = torch.zeros(WIDTH, dtype=torch.bool)
    ids = prompt + completion
    tokens[: len(ids)] = torch.tensor(ids)
    mask[len(prompt) : len(ids)] = True
    return PreferenceSample(tokens, mask, label=label)


class Examples:
    def __init__(self, examples):
        self.examples, self.pad = examples, PAD

    def __len__(self):
        return len(self.examples)

    def sample(self, i):
        return self.examples[i]


EXAMPLES = [
    _example([1, 2, 3], [10, 11], True),
    _example([4, 5], [20, 21, 22], False),
    _example([6], [30], True),
    _example([7, 8, 9, 9], [40, 41, 42, 43, 44], False),
]


def test_kl_row_is_the_prompt_with_the_other_completion_cut_to_the_row():
    row = kl_row(EXAMPLES[0], EXAMPLES[3], PAD)  # 3 prompt tokens + 5 completion tokens
    assert row.tokens.tolist() == [1, 2, 3, 40, 41, 42, 43, 44, PAD, PAD]
    assert row.loss_mask.tolist() == [False] * 3 + [True] * 5 + [False] * 2
    cut = kl_row(EXAMPLES[3], EXAMPLES[3], PAD)  # 4 + 5 of 10: fits; a longer one is cut at the row's end
    assert cut.tokens.tolist()[:9] == [7, 8, 9, 9, 40, 41, 42, 43, 44]
    long = kl_row(_example([1, 2, 3, 4, 5, 6, 7], [8], True), EXAMPLES[3], PAD)
    assert long.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 40, 41, 42] and long.loss_mask.sum() == 3


def test_kto_rows_rotate_over_the_global_batch_on_every_rank():
    """Each rank's KL rows use the previous example of the whole global batch, so dp2 reads what one process
    reads, and undesirable examples' completion labels come marked."""
    ds = Examples(EXAMPLES)
    one = GlobalBatches(SampleOrder(4, 0, False), 4).host_inputs(ds, 0, VOCAB, IGNORE, "f", "kto")
    halves = [
        GlobalBatches(SampleOrder(4, 0, False), 4, r, 2).host_inputs(ds, 0, VOCAB, IGNORE, "f", "kto") for r in (0, 1)
    ]
    for i in range(2):
        assert torch.equal(torch.cat([h[i] for h in halves]), one[i])
    inputs, labels, _ = one
    assert inputs[1].tolist()[:5] == [1, 2, 3, 40, 41]  # example 0's KL row: the last example's completion
    assert inputs[3].tolist()[:5] == [4, 5, 10, 11, 0]  # example 1's: example 0's
    plain, marked = unmark(labels, VOCAB, IGNORE)
    assert (marked[0::2] != IGNORE).any(-1).tolist() == [False, True, False, True]  # the undesirable ones
    assert torch.where(marked != IGNORE, marked, plain)[2].tolist()[:5] == [IGNORE, 20, 21, 22, IGNORE]
    assert (marked[1::2] == IGNORE).all()  # KL rows carry no mark


def test_orpo_marks_the_chosen_prompt():
    pair = PreferenceSample(EXAMPLES[0].tokens, EXAMPLES[0].loss_mask, rejected=EXAMPLES[1].tokens,
                            rejected_mask=EXAMPLES[1].loss_mask)  # fmt: skip
    _, labels, _ = GlobalBatches(SampleOrder(1, 0, False), 1).host_inputs(
        Examples([pair]), 0, VOCAB, IGNORE, "f", "orpo"
    )
    plain, prompt = unmark(labels, VOCAB, IGNORE)
    assert prompt[0].tolist()[:4] == [2, 3, IGNORE, IGNORE]  # the chosen prompt's tokens after the first
    assert plain[0].tolist()[:4] == [IGNORE, IGNORE, 10, 11] and (prompt[1] == IGNORE).all()
