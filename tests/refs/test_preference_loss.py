"""The preference losses (train/preference_loss.py) against TRL 1.16's own code on the same inputs.

TRL's loss code is called as written, unbound, with a stub `self` carrying only the attributes it reads (listed in
`_dpo_self`, `_kto_self`, `SimpleNamespace(beta=..., accelerator=...)`) and, for DPO and KTO, a stub model whose
output carries the per-token `log_probs` TRL's fused LM head would return: a trainer instance would need a model,
datasets and an accelerator, none of which the loss reads. The log-probs themselves are tested separately against
TRL's fused LM head on a tiny transformers model.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from meshformer.train import preference_loss as pl

trl = pytest.importorskip("trl")

REL = 1e-6


class _Accelerator:
    device = torch.device("cpu")

    def gather_for_metrics(self, t):
        return t

    gather = gather_for_metrics

    def unwrap_model(self, m):
        return m


def _close(ours, theirs, what=""):
    ours, theirs = float(ours), float(theirs)
    assert abs(ours - theirs) <= REL * max(abs(theirs), 1e-12), f"{what}: {ours} vs TRL {theirs}"


def _pairs(pairs=5, length=9, seed=0, dtype=torch.float64):
    """A DPO batch as TRL's collator makes it (chosen rows, then rejected rows), with per-token log-probs that are 0
    off the completion, and precomputed reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    completion = torch.zeros(2 * pairs, length, dtype=torch.long)
    for row in range(2 * pairs):
        start = int(torch.randint(1, length // 2, (1,), generator=g))
        end = int(torch.randint(start + 1, length + 1, (1,), generator=g))
        completion[row, start:end] = 1
    per_token = -torch.rand(2 * pairs, length - 1, generator=g, dtype=dtype) * 3 * completion[:, 1:]
    ref = -torch.rand(2 * pairs, generator=g, dtype=dtype) * 3 * completion[:, 1:].sum(1)
    return completion, per_token, ref


def _dpo_self(loss_types, weights, beta, eps):
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=list(loss_types),
        loss_weights=list(weights),
        beta=beta,
        label_smoothing=eps,
        use_weighting=False,
        args=SimpleNamespace(discopop_tau=pl.DISCOPOP_TAU, gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


def _stub_model(per_token):
    zeros = torch.zeros_like(per_token)
    return lambda **_: SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def _trl_dpo(loss_types, weights, beta, eps, completion, per_token, ref):
    from trl import DPOTrainer

    stub = _dpo_self(loss_types, weights, beta, eps)
    p = completion.shape[0] // 2
    inputs = {
        "input_ids": torch.ones_like(completion),
        "attention_mask": torch.ones_like(completion),
        "completion_mask": completion,
        "ref_chosen_logps": ref[:p],
        "ref_rejected_logps": ref[p:],
    }
    loss = DPOTrainer._compute_loss(stub, _stub_model(per_token), inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


def _ours_dpo(loss_types, weights, beta, eps, completion, per_token, ref):
    p = completion.shape[0] // 2
    logps, lengths = per_token.sum(1), completion[:, 1:].sum(1)
    return pl.dpo_loss(
        logps[:p],
        logps[p:],
        ref[:p],
        ref[p:],
        beta=beta,
        loss_type=loss_types,
        loss_weights=weights,
        label_smoothing=eps,
        chosen_lengths=lengths[:p],
        rejected_lengths=lengths[p:],
    )


METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@pytest.mark.parametrize("kind", [k for k in pl.DPO_LOSS_TYPES if k != "cdpo"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_each_dpo_loss_type_equals_trl(kind, dtype):
    eps = 0.1 if kind in ("robust", "exo_pair") else 0.0
    batch = _pairs(dtype=dtype, seed=len(kind))
    theirs, their_metrics = _trl_dpo([kind], [1.0], 0.3, eps, *batch)
    ours, our_metrics = _ours_dpo([kind], None, 0.3, eps, *batch)
    _close(ours, theirs, kind)
    for name in METRICS:
        _close(our_metrics[name], their_metrics[name], f"{kind} {name}")
    assert 0 < float(our_metrics["rewards/accuracies"]) < 1  # the batch has pairs both ways: the metric can fail


def test_combined_loss_types_with_weights_equal_trl():
    mpo = (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0])
    batch = _pairs(pairs=7, seed=3)
    theirs, _ = _trl_dpo(*mpo, 0.1, 0.0, *batch)
    ours, metrics = _ours_dpo(*mpo, 0.1, 0.0, *batch)
    _close(ours, theirs, "mpo")
    _close(metrics["per_pair"].mean(), theirs, "per-pair mean")
    single, _ = _ours_dpo(["sigmoid"], None, 0.1, 0.0, *batch)
    assert abs(float(single) - float(theirs)) > 1e-3  # the weights and extra terms matter


def test_sigmoid_has_no_label_smoothing_in_trl_1_16():
    batch = _pairs(seed=5)
    theirs, _ = _trl_dpo(["sigmoid"], [1.0], 0.1, 0.2, *batch)
    ours, _ = _ours_dpo(["sigmoid"], None, 0.1, 0.2, *batch)
    cdpo, _ = _ours_dpo(["robust"], None, 0.1, 0.2, *batch)
    _close(ours, theirs)
    assert abs(float(cdpo) - float(theirs)) > 1e-4


def test_cdpo_is_the_conservative_sigmoid_of_trl_cpo_and_old_dpo():
    from trl.experimental.cpo import CPOTrainer

    completion, per_token, ref = _pairs(seed=8)
    ours, _ = _ours_dpo(["cdpo"], None, 0.3, 0.2, completion, per_token, ref)
    p = completion.shape[0] // 2
    ratios = per_token.sum(1) - ref  # CPO's sigmoid on (r_c, r_r) is -(1-eps) log sig(beta D) - eps log sig(-beta D)
    stub = SimpleNamespace(beta=0.3, label_smoothing=0.2, loss_type="sigmoid", alpha=0.0, accelerator=_Accelerator())
    theirs, _, _ = CPOTrainer.cpo_loss(stub, ratios[:p], ratios[p:])
    _close(ours, theirs.mean(), "cdpo")


def test_every_loss_type_the_config_accepts_is_computed():
    """The config's choices are the loss module's list: each one gives a finite loss (none is a name without code)."""
    from meshformer.config import preference_schema

    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (torch.randn(4, generator=g, dtype=torch.float64) - 5 for _ in range(4))
    for kind in preference_schema.DPO_LOSS_TYPES:
        smoothing = 0.1 if kind in ("robust", "cdpo", "exo_pair") else 0.0
        lengths = {"chosen_lengths": torch.full((4,), 3.0), "rejected_lengths": torch.full((4,), 5.0)}
        loss, _ = pl.dpo_loss(c, r, rc, rr, beta=0.1, loss_type=kind, label_smoothing=smoothing, **lengths)
        assert torch.isfinite(loss), kind
    with pytest.raises(ValueError, match="unknown DPO loss type"):
        pl.dpo_loss(c, r, rc, rr, loss_type="aot")


def _kto_self(beta, wd, wu, loss_type):
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        calculate_KL=True,
        loss_type=loss_type,
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


@pytest.mark.parametrize("loss_type", pl.KTO_LOSS_TYPES)
@pytest.mark.parametrize("kl_sign", [1.0, -1.0])
def test_kto_loss_equals_trl(loss_type, kl_sign):
    from trl import KTOTrainer

    completion, per_token, ref = _pairs(pairs=4, seed=11)
    n = completion.shape[0]
    labels = torch.tensor([True, False, True, True, False, False, True, False])
    g = torch.Generator().manual_seed(1)
    kl_per_token = -torch.rand(n, per_token.shape[1], generator=g, dtype=per_token.dtype) * completion[:, 1:]
    ref_kl = kl_per_token.sum(1) - kl_sign * torch.rand(n, generator=g, dtype=per_token.dtype)
    calls = iter([kl_per_token, per_token])  # TRL runs the KL forward first, then the completions
    model = lambda **_: _stub_model(next(calls))()  # noqa: E731
    stub = _kto_self(0.2, 1.3, 0.7, loss_type)
    stub._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(stub, m, b)
    inputs = {
        "input_ids": torch.ones_like(completion),
        "attention_mask": torch.ones_like(completion),
        "completion_mask": completion,
        "KL_input_ids": torch.ones_like(completion),
        "KL_attention_mask": torch.ones_like(completion),
        "KL_completion_mask": completion,
        "label": labels,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    theirs = KTOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    their_metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}
    ours, metrics = pl.kto_loss(
        per_token.sum(1), ref, labels, kl_per_token.sum(1), ref_kl, beta=0.2, desirable_weight=1.3,
        undesirable_weight=0.7, loss_type=loss_type,
    )  # fmt: skip
    _close(ours, theirs, loss_type)
    for name in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        _close(metrics[name], their_metrics[name], name)
    assert (float(metrics["kl"]) > 0) == (kl_sign > 0)  # the clamp at 0 is exercised both ways
    _close(metrics["per_example"].mean(), theirs, "per-example mean")


def test_kto_kl_order_rotates_by_one_as_trl():
    completions = ["a", "b", "c", "d"]
    assert [completions[i] for i in pl.kto_kl_order(4)] == completions[-1:] + completions[:-1]


def test_orpo_loss_equals_trl():
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(2)
    chosen, rejected = -torch.rand(6, generator=g) * 2, -torch.rand(6, generator=g) * 2
    chosen[0] = -0.01  # both sides of log1mexp's branch at -log 2
    nll = torch.tensor(1.7)
    stub = SimpleNamespace(beta=0.25, accelerator=_Accelerator())
    losses, c_rew, r_rew, ratio, log_odds = ORPOTrainer.odds_ratio_loss(stub, chosen, rejected)
    ours, metrics = pl.orpo_loss(chosen, rejected, nll, beta=0.25)
    _close(ours, nll - losses.mean(), "orpo")  # ORPOTrainer.get_batch_loss_metrics: nll - losses.mean()
    _close(metrics["rewards/chosen"], c_rew.mean())
    _close(metrics["rewards/rejected"], r_rew.mean())
    _close(metrics["log_odds_ratio"], ratio)
    _close(metrics["log_odds_chosen"], log_odds)


@pytest.mark.parametrize("eps", [0.0, 0.15])
def test_simpo_loss_equals_trl_cpo_with_alpha_zero(eps):
    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(4)
    chosen, rejected = (
        -torch.rand(6, generator=g, dtype=torch.float64),
        -torch.rand(6, generator=g, dtype=torch.float64),
    )
    stub = SimpleNamespace(
        beta=2.0, simpo_gamma=0.6, label_smoothing=eps, loss_type="simpo", alpha=0.0, accelerator=_Accelerator()
    )
    losses, c_rew, r_rew = CPOTrainer.cpo_loss(stub, chosen, rejected)
    ours, metrics = pl.simpo_loss(chosen, rejected, beta=2.0, gamma=0.6, label_smoothing=eps)
    _close(ours, losses.mean(), "simpo")  # get_batch_loss_metrics: losses.mean() + cpo_alpha * nll, alpha 0
    _close(metrics["rewards/margins"], (c_rew - r_rew).mean())
    with_bc, _ = pl.simpo_loss(chosen, rejected, beta=2.0, gamma=0.6, cpo_alpha=1.0, nll=torch.tensor(0.5))
    _close(with_bc, pl.simpo_loss(chosen, rejected, beta=2.0, gamma=0.6)[0] + 0.5, "cpo-simpo")


def _tiny_llama(seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def test_sequence_logps_equal_trl_fused_lm_head_on_a_tiny_model():
    from trl.trainer.utils import add_fused_lm_head

    model = _tiny_llama()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 61, (4, 12), generator=g)
    completion = torch.zeros_like(ids)
    for row, (a, b) in enumerate([(3, 12), (5, 9), (2, 4), (6, 12)]):
        completion[row, a:b] = 1
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        add_fused_lm_head(model)
        out = model(input_ids=ids, labels=ids.masked_fill(completion == 0, -100), fused_lm_head=True)
    theirs = out.log_probs
    ours = pl.token_logps(logits, ids, completion)
    assert torch.allclose(ours, theirs.to(ours.dtype), rtol=1e-5, atol=1e-6)
    summed, mean = pl.sequence_logps(logits, ids, completion), pl.sequence_logps(logits, ids, completion, average=True)
    assert torch.allclose(summed, theirs.sum(1), rtol=1e-5)
    assert torch.allclose(mean, theirs.sum(1) / completion[:, 1:].sum(1), rtol=1e-5)
    assert not torch.allclose(summed, mean)


def test_average_log_probs_equal_orpo_and_cpo_get_batch_logps():
    from trl.experimental.orpo import ORPOTrainer

    model = _tiny_llama(1)
    ids = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(1))
    completion = torch.zeros_like(ids)
    completion[:, 4:] = 1
    completion[1, 8:] = 0
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    labels = ids.masked_fill(completion == 0, -100)
    theirs = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    assert torch.allclose(pl.sequence_logps(logits, ids, completion, average=True), theirs, rtol=1e-6)
    attention = torch.ones_like(ids)
    attention[2, 7:] = 0
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 61), ids.masked_fill(attention == 0, -100)[:, 1:].reshape(-1)
    )
    _close(pl.orpo_nll(logits, ids, attention), nll, "orpo nll (prompt included)")
