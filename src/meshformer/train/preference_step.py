"""The preference step's loss (DPO and TRL's loss types, SimPO, ORPO, KTO): what the model parts call per
micro-batch in place of the token cross-entropy, and the step's preparation and metrics around it.

Rows (data/preference_rows.py): every sample is two adjacent rows, so a micro-batch (and a pipeline micro-batch) of
`batch_size` samples holds 2 x batch_size rows and never splits one: a pair's chosen then rejected; a KTO example's
own sequence then its KL sequence (its prompt with the previous example's completion). Labels keep the completion's
tokens only (the prompt and the padding are ignored), so a row's summed log-probability is minus its summed token
cross-entropy: the same arithmetic as SFT's loss, vocab-sharded under tensor parallelism; under context parallelism
each rank holds part of every row and the row sums are all-reduced over the cp ranks (an autograd all-reduce: the
gradient reaches every rank's tokens). ORPO's chosen rows also carry their prompt tokens (marked labels), since its
NLL term covers the prompt as TRL 1.16 computes it; a KTO example's label (desirable or not) comes marked too.

Targets: the parts hand the loss (logits, targets), and what a row needs besides its labels must travel with it
through accumulation and pipeline schedules; so targets are float64 [rows, seq + 1] (KTO: seq + 2): the labels
(token ids, exact in float64), for KTO the example's desirability, and last the reference's summed
log-probability of the row's completion.

Normalisation (as SFT's, train/step.py): the loss of a micro-batch is a SUM over its samples of the per-sample
loss; the step divides by the global number of samples (every data-parallel rank, every accumulation and pipeline
micro-batch), so every layout and accumulation split gives the mean over the global batch, TRL's full-batch loss.
A token-mean term (TRL's `sft` loss type with `sft_weight`; ORPO's NLL) is a mean over all chosen rows' tokens of
the step: its sum enters with the factor samples / tokens (global counts, known before the forward). Under context
parallelism every cp rank computes the same sample losses, so each adds 1/cp of them.

KTO's KL estimate z0 (TRL 1.16 KTOTrainer): the mean over the KL rows of the policy's minus the reference's
log-probability, detached, clamped >= 0. It enters every example's loss, so it is computed before the step's
forward: the policy runs forward only over the KL rows (no gradient: TRL detaches it), beside the reference's
forward, and the mean is over the whole global batch, so every layout and accumulation split has the same z0.
TRL takes it per device batch and averages the devices' means: one process and a full batch make the two equal.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshformer.config.schema import MeshformerConfig
from meshformer.data.preference_rows import unmark
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.parallel import ParallelEnv
from meshformer.parallel.context_parallel import local_sequence
from meshformer.train.frozen_model import FrozenModel
from meshformer.train.precomputed_reference import PrecomputedReference
from meshformer.train.preference_loss import dpo_loss, kto_per_example, orpo_log_odds, simpo_loss

BUILT_METHODS = ("dpo", "kto", "orpo", "simpo")
# TRL's metric names of a pair method, each a mean over the pairs of the step (or of the validation batches)
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")  # experimental ORPOTrainer's own
# one micro-batch's record: the sums the step's metrics and the validation loss are made of. sample_loss: the
# per-sample losses; token_nll / tokens: the token-mean term; chosen / rejected: how many of each (a pair: one each)
_RECORD = (
    "sample_loss", "token_nll", "tokens", "samples", "chosen", "rejected", "rewards/chosen", "rewards/rejected",
    "rewards/accuracies", "logps/chosen", "logps/rejected", "log_odds_ratio", "log_odds_chosen", "kl",
)  # fmt: skip


def trains_preferences(cfg: MeshformerConfig) -> bool:
    return cfg.preference_config.method != "none"


def preference_rows(cfg: MeshformerConfig) -> str | None:
    """How the run's samples become rows (data/preference_rows.py ROW_KINDS), None for a run that is not one."""
    method = cfg.preference_config.method
    return None if method == "none" else method if method in ("kto", "orpo") else "pairs"


def check_preference_data(cfg: MeshformerConfig, kind: str | None, global_batch: int) -> None:
    """Refuse, in one line, data of the other kind (pairs for KTO, unpaired examples for the pair methods), and a
    KTO global batch of one example (its KL row would be its own sequence: TRL refuses a batch of 1 too)."""
    method, dl = cfg.preference_config.method, cfg.train_dataset.data_loader
    want = "unpaired" if method == "kto" else "pairs"
    if kind == want and method == "kto" and global_batch < 2:
        raise UserError(
            f"train_dataset.batch_size={cfg.train_dataset.batch_size}: a KTO global batch of {global_batch} example "
            f"leaves its KL term (each prompt with another example's completion) nothing to pair: use 2 or more"
        )
    if kind == want:
        return
    what = {"pairs": "prompt/chosen/rejected pairs", "unpaired": "prompt/completion/label (KTO) examples"}
    raise UserError(
        f"preference_config.method={method} trains on {what[want]}, but train_dataset.data_loader ({dl.type}, "
        f"{dl.dataset_dir!r}) holds {what.get(kind, 'no preference data')}: preprocess {what[want]} and set "
        f"data_loader.type: PreferenceDataset"
    )


def check_built(cfg: MeshformerConfig) -> None:
    """Refuse, in one line, what the step does not compute (rather than training something else)."""
    pc = cfg.preference_config
    if pc.method not in ("none", *BUILT_METHODS):
        raise UserError(f"preference_config.method={pc.method}: not built: use one of {', '.join(BUILT_METHODS)}")
    if pc.method in ("kto", "orpo") and pc.sft_weight:
        raise UserError(
            f"preference_config.sft_weight={pc.sft_weight}: {pc.method} has no added SFT term in TRL 1.16 "
            f"(ORPO's NLL is part of its loss): set sft_weight: 0"
        )


def token_nll(logits: torch.Tensor, labels: torch.Tensor, ignore: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, seq] each labelled token's cross-entropy (0 where ignored; this rank's part of the row under cp), from
    logits [rows, seq, vocab] (vocab-sharded DTensor under tensor parallelism's loss context)."""
    nll = F.cross_entropy(logits.flatten(0, 1).to(dtype), labels.flatten(), ignore_index=ignore, reduction="none")
    if isinstance(nll, DTensor):
        nll = nll.full_tensor()
    return nll.float().view(labels.shape)


def row_logps(logits: torch.Tensor, labels: torch.Tensor, ignore: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows] summed log-probability of each row's labelled tokens (this rank's part of the row under cp)."""
    return -token_nll(logits, labels, ignore, dtype).sum(-1)


class PreferenceObjective:
    """The loss function the model parts call, (logits, targets) -> this micro-batch's share of the step's loss."""

    def __init__(self, cfg: MeshformerConfig, env: ParallelEnv):
        pc, mc = cfg.preference_config, cfg.model.model_config
        self.pc, self.env, self.method = pc, env, pc.method
        self.ignore, self.dtype, self.vocab = mc.ignore_token_id, DTYPE[mc.softmax_compute_dtype], mc.vocab_size
        kinds = pc.loss_types() if pc.method == "dpo" else []
        weights = list(pc.loss_weights) if pc.loss_weights is not None else [1.0] * len(kinds)
        self.pair_kinds = [(k, float(w)) for k, w in zip(kinds, weights) if k != "sft"]
        self.sft_weight = pc.sft_weight + sum(float(w) for k, w in zip(kinds, weights) if k == "sft")
        if pc.method == "orpo":
            self.sft_weight = 1.0  # ORPO's NLL term: the chosen rows' token mean, prompt included
        self.average = pc.method in ("orpo", "simpo")  # their log-probs are per-token means
        self.columns = 2 if pc.method == "kto" else 1  # targets' columns after the labels
        # FrozenModel (train/frozen_model.py) or PrecomputedReference, set by whoever built it; None: reference-free
        self.reference = None
        self.policy_parts = None  # the policy's ModelParts (train/step.py): KTO's KL estimate runs them forward
        self.token_unit: torch.Tensor | float = 0.0
        self.kl: torch.Tensor | None = None  # KTO's z0 of the step
        self.kl_measure = contextlib.nullcontext  # what the memory meter watches KTO's KL pass with
        self.records: list[torch.Tensor] = []

    # ---- before the forward/backward -------------------------------------------------------------------
    def prepare(
        self, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None, n_micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(targets, the step's global sample count) for this rank's rows (already cut to its cp tokens): the
        reference's forward (and KTO's KL estimate) runs here, for all micro-batches, before the policy's."""
        env = self.env
        rows, seq = labels.shape
        targets = torch.empty((rows, seq + self.columns), dtype=torch.float64, device=labels.device)
        if self.method == "kto":
            plain, marked = unmark(labels, self.vocab, self.ignore)
            undesirable = self._cp_sum((marked[0::2] != self.ignore).sum(-1).double(), grad=False)
            labels = torch.where(marked != self.ignore, marked, plain)
            targets[:, -2] = (undesirable == 0).double().repeat_interleave(2)
        targets[:, :seq] = labels
        samples = torch.tensor(rows // 2 * env.mesh_size("batch"), dtype=torch.float64, device=labels.device)
        targets[:, -1] = 0
        if isinstance(self.reference, PrecomputedReference):  # stored full-row sums: no cp sum
            targets[:, -1] = self.reference.rows(rows, labels.device)
        elif self.reference is not None:
            targets[:, -1] = self.reference_rows(self.reference, inputs, labels, documents, n_micro)
        elif self.pc.reference_kind() != "none":
            raise RuntimeError(f"preference_config.reference={self.pc.reference_kind()}: no reference was set")
        if self.method == "kto":
            self.kl = self._kl_estimate(inputs, labels, documents, n_micro, targets[1::2, -1], samples)
        if self.sft_weight:
            chosen = (labels[0::2] != self.ignore).sum().to(torch.float64)
            self.token_unit = (samples / env.reduce_sum(chosen, "loss").clamp(min=1)).float()
        self.records = []
        return targets, samples

    def _kl_estimate(self, inputs, labels, documents, n_micro: int, ref_kl, samples) -> torch.Tensor:
        """KTO's z0: mean over the global batch's KL rows (odd rows) of policy minus reference log-probability,
        clamped >= 0; the policy runs forward only (TRL detaches z0)."""
        docs = documents[1::2] if documents is not None else None
        frozen = FrozenModel(self.policy_parts, contextlib.nullcontext)
        frozen.measure = self.kl_measure
        policy = self.reference_rows(frozen, inputs[1::2], labels[1::2], docs, n_micro)
        env = self.env
        total = env.reduce_sum((policy - ref_kl).sum().clone(), "loss") / env.dims.cp
        return (total / samples).clamp(min=0)

    def reference_rows(
        self, frozen: FrozenModel, inputs: torch.Tensor, labels: torch.Tensor, documents, n_micro: int
    ) -> torch.Tensor:
        """[rows] float64: the frozen model's summed log-probability of each row's completion (this rank's rows,
        already cut to its cp tokens; the sums cover the whole row), forward only, micro-batch by micro-batch.
        Under pipeline parallelism on the last stage's ranks, where the loss reads them; zeros on the others."""
        chunks = labels.chunk(n_micro)

        def reference_logps(logits: torch.Tensor, i: int) -> torch.Tensor:
            return row_logps(logits, chunks[i], self.ignore, self.dtype)

        got = frozen.map_logits(inputs, documents, n_micro, reference_logps)
        rows = torch.cat(got).double() if got else labels.new_zeros(labels.shape[0], dtype=torch.float64)
        return self._cp_sum(rows, grad=False)

    # ---- per micro-batch -------------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seq = targets.shape[1] - self.columns
        labels, ref = targets[:, :seq].long(), targets[:, -1]
        full = labels
        if self.method == "orpo":  # the NLL's labels: the prompt's marked ones too
            labels, prompt = unmark(labels, self.vocab, self.ignore)
            full = torch.where(prompt != self.ignore, prompt, labels)
        nll = token_nll(logits, full, self.ignore, self.dtype)
        completion = labels != self.ignore
        summed = self._cp_sum(-(nll * completion).sum(-1), grad=True)
        lengths = self._cp_sum(completion.sum(-1).float(), grad=False)
        logps = summed / lengths.clamp(min=1) if self.average else summed
        if self.method == "kto":
            rec = self._kto(logps[0::2], ref[0::2].to(logps.dtype), targets[0::2, -2] > 0.5)
            token_nll_sum, tokens = logps.new_zeros(()), logps.new_zeros(())
        else:
            rec = self._pairs(logps[0::2], logps[1::2], ref, lengths)
            if self.method == "orpo":
                token_nll_sum = self._cp_sum(nll[0::2].sum(-1), grad=True).sum()
                tokens = self._cp_sum((full[0::2] != self.ignore).sum(-1).float(), grad=False).sum()
            else:
                token_nll_sum, tokens = -summed[0::2].sum(), lengths[0::2].sum()
        loss = rec["sample_loss"]
        if self.sft_weight:
            loss = loss + self.sft_weight * self.token_unit * token_nll_sum
        rec.update(token_nll=token_nll_sum, tokens=tokens)
        zero = loss.new_zeros(())
        self.records.append(torch.stack([rec.get(k, zero).detach().to(torch.float64) for k in _RECORD]))
        return loss / self.env.dims.cp

    def _pairs(self, c: torch.Tensor, r: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor) -> dict:
        """The per-pair loss summed, and the record's sums, of DPO, SimPO or ORPO's pair term."""
        pc, rec = self.pc, {}
        if self.method == "simpo":
            _, m = simpo_loss(c, r, beta=pc.beta, gamma=pc.simpo_gamma, label_smoothing=pc.label_smoothing)
            per_pair, reward_c, reward_r = m["per_pair"], pc.beta * c.detach(), pc.beta * r.detach()
        elif self.method == "orpo":
            log_odds = orpo_log_odds(c, r)
            ratio = F.logsigmoid(log_odds)
            per_pair, reward_c, reward_r = -pc.beta * ratio, pc.beta * c.detach(), pc.beta * r.detach()
            rec.update({"log_odds_ratio": ratio.sum(), "log_odds_chosen": log_odds.sum()})
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
        n = torch.tensor(float(c.shape[0]), device=c.device)
        rec.update({"sample_loss": per_pair.sum(), "samples": n, "chosen": n, "rejected": n})
        rec.update({"rewards/chosen": reward_c.sum(), "rewards/rejected": reward_r.sum()})
        rec.update({"rewards/accuracies": (reward_c > reward_r).float().sum(), "logps/chosen": c.sum()})
        rec["logps/rejected"] = r.sum()
        return rec

    def _kto(self, logps: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor) -> dict:
        """The per-example KTO loss summed, and the record's sums (TRL names a desirable example `chosen`)."""
        pc = self.pc
        per_example = kto_per_example(
            logps - ref, desirable, self.kl.to(logps.dtype), pc.beta, pc.desirable_weight, pc.undesirable_weight,
            pc.loss_types()[0],
        )  # fmt: skip
        rewards, d, u = pc.beta * (logps - ref).detach(), desirable.to(logps.dtype), (~desirable).to(logps.dtype)
        n = torch.tensor(float(logps.shape[0]), device=logps.device)
        return {
            "sample_loss": per_example.sum(), "samples": n, "chosen": d.sum(), "rejected": u.sum(),
            "rewards/chosen": (rewards * d).sum(), "rewards/rejected": (rewards * u).sum(),
            "logps/chosen": (logps.detach() * d).sum(), "logps/rejected": (logps.detach() * u).sum(),
            "kl": self.kl * n,
        }  # fmt: skip

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
        """The records' sums over every rank of the step (cp ranks hold the same samples: counted once)."""
        env = self.env
        local = torch.stack(records).sum(0) if records else torch.zeros(len(_RECORD), dtype=torch.float64)
        local = local.to(env.device)
        return env.all_reduce_sum_pp(env.reduce_sum(local, "loss")) / env.dims.cp

    def step_metrics(self, n_micro: int) -> dict[str, float]:
        """TRL's metrics of the step, means over its samples (a pipeline schedule may call the loss once more to
        infer shapes: the step's own calls are the last n_micro)."""
        return self._metrics(self._totals(self.records[-n_micro:]).tolist())

    @torch.no_grad()
    def evaluate(self, parts, batches, micro_batch: int) -> dict[str, float]:
        """eval_loss and TRL's metrics over validation batches (rows as in training; `micro_batch` samples per
        forward)."""
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
        out = self._metrics(sums)
        got = dict(zip(_RECORD, sums))
        out["loss"] = got["sample_loss"] / max(got["samples"], 1) + (
            self.sft_weight * got["token_nll"] / max(got["tokens"], 1) if self.sft_weight else 0.0
        )
        return out

    def _metrics(self, sums: list[float]) -> dict[str, float]:
        """TRL's names: rewards and log-probs as means over the chosen (desirable) and rejected samples, margins
        their difference; a pair method's accuracies, ORPO's NLL and log odds, KTO's kl."""
        got = dict(zip(_RECORD, sums))
        n_c, n_r, n = got["chosen"], got["rejected"], max(got["samples"], 1.0)
        out = {}
        if n_c:
            out.update({k: got[k] / n_c for k in ("rewards/chosen", "logps/chosen")})
        if n_r:
            out.update({k: got[k] / n_r for k in ("rewards/rejected", "logps/rejected")})
        if n_c and n_r:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        if self.method == "kto":
            out["kl"] = got["kl"] / n
            return out
        out["rewards/accuracies"] = got["rewards/accuracies"] / n
        if self.method == "orpo":
            out.update(nll_loss=got["token_nll"] / max(got["tokens"], 1.0), log_odds_ratio=got["log_odds_ratio"] / n)
            out["log_odds_chosen"] = got["log_odds_chosen"] / n
        return out
