"""`preference_config.reference: precomputed`: the reference's log-probabilities computed once, before step 1, and
read back by sample index, so no second model lives through training.

The reference of a preference run is its starting weights. Before the first step the policy *is* those weights,
so the one pass runs the policy itself, forward only, in eval mode, under no grad (with its LoRA adapters off,
which at the start changes nothing but says what is meant), under the run's own layout and arithmetic
(train/preference_step.py `PreferenceObjective.reference_rows`: the same per-row sums, vocab-sharded under tensor
parallelism, summed over context-parallel ranks, through the pipeline's stages forward-only under pipeline
parallelism). Every data-parallel rank computes its share of the pairs; one sum over the batch ranks (and the
pipeline stages: the last one holds the sums) gives every rank the whole table, and the step reads the rows of its
own micro-batches.

A table is float64 [pairs, 2]: the summed completion log-probability of each pair's chosen and rejected sequence,
row i for sample index i of the split. The tables are stored with the run (output_dir/reference_logps.safetensors,
never a pickle) with a checksum of the data they were computed on; a resumed run reads them back instead of
computing again (its policy is no longer the reference), and refuses them when the data is not the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from meshformer.data.dataset import batch_inputs, rows_of_pairs
from meshformer.data.protocol import fingerprint
from meshformer.errors import UserError
from meshformer.parallel import ModelParts, ParallelEnv
from meshformer.parallel.context_parallel import local_sequence
from meshformer.train.frozen_model import FrozenModel

FILE = "reference_logps.safetensors"

# ids -> (inputs, labels, documents) of those pairs' rows (chosen, rejected adjacent), on the host
ReadPairs = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
# (inputs, labels, documents) of this rank's rows -> their reference log-probs [rows]
RowLogps = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@torch.no_grad()
def compute_table(env: ParallelEnv, n_pairs: int, pairs_per_forward: int, read: ReadPairs, logps: RowLogps):
    """float64 [n_pairs, 2] on every rank: each data-parallel rank runs forwards of `pairs_per_forward` pairs
    over its contiguous share, the same number of forwards on every rank (a rank past the end repeats pair 0
    and drops it: sharded weights gather on every forward), then one sum over the batch ranks and the pipeline
    stages."""
    dp, rank = env.mesh_size("batch"), env.dp_rank
    table = torch.zeros((n_pairs, 2), dtype=torch.float64, device=env.device)
    per_round = dp * pairs_per_forward
    for start in range(0, n_pairs, per_round):
        lo = start + rank * pairs_per_forward
        ids = torch.arange(lo, min(lo + pairs_per_forward, n_pairs))
        real = len(ids)
        if real == 0:
            ids = torch.zeros(1, dtype=torch.long)
        inputs, labels, documents = read(ids)
        dev = env.device
        rows = logps(inputs.to(dev), labels.to(dev), None if documents is None else documents.to(dev))
        if real:
            table[ids] = rows.to(torch.float64).view(-1, 2)
    # under pipeline parallelism only the last stage's ranks hold the sums (zeros elsewhere): the pp sum hands
    # every stage the table, rank 0 (the first stage) included, which saves it
    return env.all_reduce_sum_pp(env.reduce_sum(table, "batch"))


def reference_table(parts: ModelParts, objective, lora: bool, n_pairs: int, pairs_per_forward: int, read: ReadPairs):
    """The table of `n_pairs` pairs from the policy's `parts` at its starting weights (before step 1), with the
    preference step's own arithmetic (`objective`: train/preference_step.py PreferenceObjective)."""
    env, frozen = objective.env, FrozenModel.starting_weights(parts, lora)

    def logps(inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        inputs, labels = local_sequence(env, inputs, labels)  # the step's cut: this cp rank's tokens
        return objective.reference_rows(frozen, inputs, labels, documents, 1)

    table = compute_table(env, n_pairs, pairs_per_forward, read, logps)
    # A forward without backward leaves FSDP's root unsharded (it reshards in backward): the gathered copies would
    # outlive the first update, so the next forwards would read the starting weights.
    parts.reshard()
    return table


def reference_for_run(cfg, data, parts: ModelParts, objective, resuming: bool, out: Path, log) -> PrecomputedReference:
    """A run's tables: read back from `out` when `resuming` (checked against the data), else computed now from
    the policy at its starting weights over the training pairs and the validation pairs (`data`: the trainer's
    TrainingData), to be saved once the run owns its output_dir (`PrecomputedReference.save`)."""
    mc = cfg.model.model_config
    splits = {"train": data.train_ds, **({"validation": data.eval_ds} if data.eval_ds is not None else {})}
    sums = {split: checksum(ds, mc.seq_length) for split, ds in splits.items()}
    if resuming:
        reference = PrecomputedReference(load_tables(out, sums), sums)
        log(f"reference log-probs read from {out / FILE}")
        return reference
    lora = mc.pet_config.pet_type == "lora"
    tables = {}
    for split, ds in splits.items():

        def read(ids: torch.Tensor, ds=ds, split=split):
            pairs = rows_of_pairs([ds.sample(int(i)) for i in ids])
            return batch_inputs(pairs, mc.vocab_size, mc.ignore_token_id, f"{split} pairs {ids.tolist()}")

        tables[split] = reference_table(parts, objective, lora, len(ds), data.plan.micro_batch, read)
    counts = ", ".join(f"{len(ds)} {split}" for split, ds in splits.items())
    log(f"reference log-probs computed before step 1 for {counts} pairs (reference: precomputed)")
    return PrecomputedReference(tables, sums, unsaved=True)


class PrecomputedReference:
    """The stored tables, and the rows of the next batch the step (or the validation) asks for.

    The trainer names a batch's pairs (`select`) before the step that reads them; the step's objective takes
    them (`rows`) in that order, one selection per `prepare` (a training step, or one validation batch)."""

    owns_weights = False  # nothing to copy or reload (train/trainer.py)

    def __init__(self, tables: dict[str, torch.Tensor], checksums: dict[str, str], unsaved: bool = False):
        """tables: split -> [pairs, 2]; checksums: split -> `checksum` of its data; unsaved: not in output_dir yet."""
        self.tables, self.checksums, self.unsaved = tables, checksums, unsaved
        self._next: list[torch.Tensor] = []

    def save(self, out: Path, env: ParallelEnv) -> None:
        """Store the tables with the run (rank 0), once."""
        if self.unsaved and env.rank == 0:
            save_tables(out, self.tables, self.checksums)
        self.unsaved = False

    def select(self, split: str, pair_ids: torch.Tensor) -> None:
        """The pairs (sample indices of `split`) of the rows the next `rows` call is for."""
        self._next.append(self.tables[split][pair_ids.long().cpu()].reshape(-1))

    def rows(self, n_rows: int, device: torch.device) -> torch.Tensor:
        """[n_rows] float64: the selected pairs' log-probs, chosen then rejected, in the rows' order."""
        if not self._next:
            raise RuntimeError("precomputed reference: no pairs selected for this batch (PrecomputedReference.select)")
        got = self._next.pop(0)
        if got.numel() != n_rows:
            raise RuntimeError(f"precomputed reference: {got.numel()} rows selected for a batch of {n_rows}")
        return got.to(device)

    def selecting(self, split: str, batches: Iterator, ids_of: Callable[[int], torch.Tensor]) -> Iterator:
        """`batches` (batch b, b = 0, 1, ...) with each one's pairs selected just before it is handed on."""
        for b, batch in enumerate(batches):
            self.select(split, ids_of(b))
            yield batch


def checksum(ds, seq_length: int) -> str:
    """What identifies the pairs a table was computed on: the dataset's count and fingerprint
    (data/protocol.py) and the row length the sequences were cut to."""
    return json.dumps({"pairs": len(ds), "seq_length": seq_length, "fingerprint": fingerprint(ds)})


def save_tables(out: Path, tables: dict[str, torch.Tensor], sums: dict[str, str]) -> Path:
    """Write the tables and their checksums (rank 0), whole or not at all (a temporary file renamed)."""
    from safetensors.torch import save_file

    path = out / FILE
    tmp = out / f".{FILE}.tmp-{os.getpid()}"
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tables.items()}, str(tmp), metadata=sums)
    os.replace(tmp, path)
    return path


def load_tables(out: Path, sums: dict[str, str]) -> dict[str, torch.Tensor]:
    """The stored tables, each checked against the checksum of the data this run reads (one line otherwise)."""
    from safetensors import SafetensorError, safe_open

    path = out / FILE
    if not path.is_file():
        raise UserError(
            f"preference_config.reference=precomputed: {path} is missing, so the resumed run cannot get its "
            f"reference log-probs (its weights are no longer the reference): restore the file, or start a new run"
        )
    try:
        with safe_open(str(path), "pt") as f:
            stored = f.metadata() or {}
            tables = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise UserError(f"preference_config.reference=precomputed: {path} is unreadable ({e}): start a new run")
    for split, want in sums.items():
        if stored.get(split) != want or split not in tables:
            raise UserError(
                f"preference_config.reference=precomputed: {path} was computed on other {split} data than this run "
                f"reads: resume on the same data, or start a new run (overwrite_output_dir: true) to compute it again"
            )
    return tables
