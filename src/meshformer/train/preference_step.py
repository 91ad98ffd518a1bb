"""The preference step's loss (DPO and TRL's loss types, SimPO): what the model parts call per micro-batch in place of
the token cross-entropy, and the step's preparation and metrics around it.

Rows: a pair is two adjacent rows, chosen then rejected (data/dataset.py `rows_of_pairs`), so a micro-batch (and a
pipeline micro-batch) of `batch_size` pairs holds 2 x batch_size rows and never splits a pair. Labels keep the
completion's tokens only (the prompt and the padding are ignored), so a row's summed log-probability is minus its
summed token cross-entropy: the same arithmetic as SFT's loss, vocab-sharded under tensor parallelism; under context
parallelism each rank holds part of every row and the row sums are all-reduced over the cp ranks (an autograd
all-reduce: the gradient reaches every rank's tokens).

Targets: the parts hand the loss (logits, targets), and the reference's log-probability of each row must travel
with its row through accumulation and pipeline schedules; so targets are float64 [rows, seq + 1]: the labels (token
ids, exact in float64) and, in the last column, the reference's summed log-probability of the row's completion.

Normalisation (as SFT's, train/step.py): the loss of a micro-batch is a SUM over its pairs of the per-pair loss;
the step divides by the global number of pairs (every data-parallel rank, every accumulation and pipeline
micro-batch), so every layout and accumulation split gives the mean over the global batch, TRL's full-batch loss.
The SFT term (TRL's `sft` loss type, `sft_weight`) is a token mean over all chosen completions of the step: its
sum enters with the factor pairs / chosen tokens (global counts, known before the forward). Under context
parallelism every cp rank computes the same pair losses, so each adds 1/cp of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.parallel import ParallelEnv
from meshformer.parallel.context_parallel import local_sequence
from meshformer.train.frozen_model import FrozenModel
from meshformer.train.precomputed_reference import PrecomputedReference
from meshformer.train.preference_loss import dpo_loss, simpo_loss

PAIRED_METHODS = ("dpo", "orpo", "simpo")
BUILT_METHODS = ("dpo", "simpo")
# TRL's metric names, each a mean over the pairs of the step (or of the validation batches)
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
# one micro-batch's record: the sums the step's metrics and the validation loss are made of
_RECORD = ("pair_loss", "sft_nll", "chosen_tokens", "pairs", *PAIR_METRICS)


def trains_preferences(cfg: MeshformerConfig) -> bool:
    return cfg.preference_config.method != "none"


def check_built(cfg: MeshformerConfig) -> None:
    """Refuse, in one line, what the step does not compute yet (rather than training something else)."""
    method = cfg.preference_config.method
    if method not in ("none", *BUILT_METHODS):
        raise UserError(
            f"preference_config.method={method}: the {method} step is not built yet: use dpo or simpo "
            f"(the {method} loss itself is train/preference_loss.py)"
        )


def row_logps(logits: torch.Tensor, labels: torch.Tensor, ignore: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows] summed log-probability of each row's labelled tokens (this rank's part of the row under cp), from
    logits [rows, seq, vocab] (vocab-sharded DTensor under tensor parallelism's loss context)."""
    nll = F.cross_entropy(logits.flatten(0, 1).to(dtype), labels.flatten(), ignore_index=ignore, reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.full_tensor()
    return -nll.float().view(labels.shape).sum(-1)


class PreferenceObjective:
    """The loss function the model parts call, (logits, targets) -> this micro-batch's share of the step's loss."""

    def __init__(self, cfg: MeshformerConfig, env: ParallelEnv):
        pc, mc = cfg.preference_config, cfg.model.model_config
        self.pc, self.env = pc, env
        self.ignore, self.dtype = mc.ignore_token_id, DTYPE[mc.softmax_compute_dtype]
        kinds = pc.loss_types() if pc.method == "dpo" else []
        weights = list(pc.loss_weights) if pc.loss_weights is not None else [1.0] * len(kinds)
        self.pair_kinds = [(k, float(w)) for k, w in zip(kinds, weights) if k != "sft"]
        self.sft_weight = pc.sft_weight + sum(float(w) for k, w in zip(kinds, weights) if k == "sft")
        self.average = pc.method in ("orpo", "simpo")  # their log-probs are per-token means
        # FrozenModel (train/frozen_model.py) or PrecomputedReference, set by whoever built it; None: reference-free
        self.reference = None
        self.token_unit: torch.Tensor | float = 0.0
        self.records: list[torch.Tensor] = []

    # ---- before the forward/backward -------------------------------------------------------------------
    def prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None, n_micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets, the step's global pair count) for this rank's rows (already cut to its cp tokens): the
        reference's forward runs here, for all micro-batches, before the policy's."""
        env = self.env
        targets = torch.empty((labels.shape[0], labels.shape[1] + 1), dtype=torch.float64, device=labels.device)
        targets[:, :-1] = labels
        if isinstance(self.reference, PrecomputedReference):  # stored full-row sums: no cp sum
            targets[:, -1] = self.reference.rows(labels.shape[0], labels.device)
        elif self.reference is not None:
            targets[:, -1] = self.reference_rows(self.reference, inputs, labels, documents, n_micro)
        elif self.pc.reference_kind() != "none":
            raise RuntimeError(f"preference_config.reference={self.pc.reference_kind()}: no reference was set")
        else:
            targets[:, -1] = 0
        pairs = torch.tensor(labels.shape[0] // 2 * env.mesh_size("batch"), dtype=torch.float64, device=labels.device)
        if self.sft_weight:
            chosen = (labels[0::2] != self.ignore).sum().to(torch.float64)
            self.token_unit = (pairs / env.reduce_sum(chosen, "loss").clamp(min=1)).float()
        self.records = []
        return targets, pairs

    def reference_rows(
        self, frozen: FrozenModel, inputs: torch.Tensor, labels: torch.Tensor, documents, n_micro: int
    ) -> torch.Tensor:
        """[rows] float64: the frozen model's summed log-probability of each row's completion (this rank's rows,
        already cut to its cp tokens; the sums cover the whole row), forward only, micro-batch by micro-batch."""
        chunks = labels.chunk(n_micro)

        def reference_logps(logits: torch.Tensor, i: int) -> torch.Tensor:
            return row_logps(logits, chunks[i], self.ignore, self.dtype)

        got = frozen.map_logits(inputs, documents, n_micro, reference_logps)
        return self._cp_sum(torch.cat(got).double(), grad=False)

    # ---- per micro-batch -------------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        labels, ref = targets[:, :-1].long(), targets[:, -1]
        summed = self._cp_sum(row_logps(logits, labels, self.ignore, self.dtype), grad=True)
        lengths = self._cp_sum((labels != self.ignore).sum(-1).float(), grad=False)
        logps = summed / lengths.clamp(min=1) if self.average else summed
        c, r = logps[0::2], logps[1::2]
        pc = self.pc
        if pc.method == "simpo":
            _, m = simpo_loss(c, r, beta=pc.beta, gamma=pc.simpo_gamma, label_smoothing=pc.label_smoothing)
            per_pair, reward_c, reward_r = m["per_pair"], pc.beta * c.detach(), pc.beta * r.detach()
        else:
            ref_c, ref_r = ref[0::2].to(c.dtype), ref[1::2].to(c.dtype)
            per_pair = torch.zeros_like(c)
            if self.pair_kinds:
                kinds, weights = zip(*self.pair_kinds)
                _, m = dpo_loss(
                    c, r, ref_c, ref_r, beta=pc.beta, loss_type=list(kinds), loss_weights=list(weights),
                    label_smoothing=pc.label_smoothing, chosen_lengths=lengths[0::2], rejected_lengths=lengths[1::2],
                )  # fmt: skip
                per_pair = m["per_pair"]
            reward_c, reward_r = pc.beta * (c - ref_c).detach(), pc.beta * (r - ref_r).detach()
        sft_nll = -summed[0::2].sum()
        loss = per_pair.sum()
        if self.sft_weight:
            loss = loss + self.sft_weight * self.token_unit * sft_nll
        record = [per_pair.sum(), sft_nll, lengths[0::2].sum(), torch.tensor(float(c.shape[0]), device=c.device)]
        record += [reward_c.sum(), reward_r.sum(), (reward_c > reward_r).float().sum(), c.sum(), r.sum()]
        self.records.append(torch.stack([t.detach().to(torch.float64) for t in record]))
        return loss / self.env.dims.cp

    def _cp_sum(self, t: torch.Tensor, grad: bool) -> torch.Tensor:
        env = self.env
        if env.dims.cp == 1:
            return t
        if grad:
            from torch.distributed.nn.functional import all_reduce

            return all_reduce(t, group=env.group("cp"))
        return env.reduce_sum(t.clone(), "cp")

    # ---- after it --------------------------------------------------------------------------------------
    def _totals(self, records: list[torch.Tensor]) -> torch.Tensor:
        """The records' sums over every rank of the step (cp ranks hold the same pairs: counted once)."""
        env = self.env
        local = torch.stack(records).sum(0) if records else torch.zeros(len(_RECORD), dtype=torch.float64)
        local = local.to(env.device)
        return env.all_reduce_sum_pp(env.reduce_sum(local, "loss")) / env.dims.cp

    def step_metrics(self, n_micro: int) -> dict[str, float]:
        """TRL's metrics of the step, means over its pairs (a pipeline schedule may call the loss once more to
        infer shapes: the step's own calls are the last n_micro)."""
        return _metrics(self._totals(self.records[-n_micro:]).tolist())

    @torch.no_grad()
    def evaluate(self, parts, batches, micro_batch: int) -> dict[str, float]:
        """eval_loss and TRL's metrics over validation batches of pairs (rows as in training; `micro_batch`
        pairs per forward)."""
        parts.train(False)
        records = []
        for inputs, labels, *_ in batches:
            inputs, labels = local_sequence(self.env, inputs, labels)
            rows = 2 * micro_batch
            targets, _ = self.prepare(inputs, labels, None, max(inputs.shape[0] // rows, 1))
            for x, t in zip(inputs.split(rows), targets.split(rows)):
                parts.eval_loss(x, t)
            records += self.records
        parts.train(True)
        self.records = []
        sums = self._totals(records).tolist()
        out = _metrics(sums)
        pair_loss = sums[0] / max(sums[3], 1)
        out["loss"] = pair_loss + (self.sft_weight * sums[1] / max(sums[2], 1) if self.sft_weight else 0.0)
        return out


def _metrics(sums: list[float]) -> dict[str, float]:
    got = dict(zip(_RECORD, sums))
    pairs = max(got["pairs"], 1.0)
    out = {name: got[name] / pairs for name in PAIR_METRICS}
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
