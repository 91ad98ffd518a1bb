"""The distillation losses (train/distill_loss.py) against TRL 1.16 on two transformers models' logits.

Two tiny Llamas of different widths and one vocabulary (the student and its teacher) read the same batch, whose
prompt tokens and right padding are not counted (labels -100, TRL's completion mask 0). TRL 1.16's
`DistillationTrainer` computes its loss in `trainer.distillation_trainer._chunked_divergence_loss` from both
models' last hidden states and LM heads; it is called here as the trainer calls it, and also GKD's
`GKDTrainer.generalized_jsd_loss` on the logits. Ours takes the logits. Loss (within 1e-5 relative) and the student
LM head's gradient (GRAD_REL) agree for forward KL, reverse KL and the JSD at several betas and temperatures.
TRL defines neither top_k nor the alpha mix with cross-entropy: those are checked against a direct computation from
the same logits (the teacher's k best indices gathered, both models' log-softmax over those k, the KL written out).
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from meshformer.train.distill_loss import distill_loss_sum, teacher_support, token_divergence

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

REL = 1e-5
# The student head's gradient: both sides fp32, TRL summing the vocabulary tile by tile in another order; measured
# differences reach about 1.1e-5 of the largest entry, so it is held to 5e-5 of it (the loss to 1e-5).
GRAD_REL = 5e-5
VOCAB = 96
PAD, PROMPT = 2, 3  # the batch's last row ends in PAD padded positions; every row's first PROMPT tokens are prompt


def _llama(hidden: int, seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # peaked next-token distributions, as a trained model's: divergences of order 1, not 1e-3
        model.lm_head.weight.mul_(40)
    return model


@pytest.fixture(scope="module")
def batch():
    student, teacher = _llama(32, 0), _llama(64, 1)
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (3, 12))
    attention = torch.ones_like(ids)
    attention[-1, -PAD:] = 0
    with torch.no_grad():
        hs_t = teacher.model(input_ids=ids, attention_mask=attention).last_hidden_state
        hs_s = student.model(input_ids=ids, attention_mask=attention).last_hidden_state
    # position t predicts token t+1: the completion mask of the predicted token, as TRL aligns hidden states
    labels = ids[:, 1:].clone()
    labels[:, : PROMPT - 1] = -100
    labels[attention[:, 1:] == 0] = -100
    return SimpleNamespace(
        student=student, teacher=teacher, hs_s=hs_s[:, :-1], hs_t=hs_t[:, :-1], labels=labels, mask=labels != -100
    )


def _close(ours, theirs, what):
    ours, theirs = float(ours), float(theirs)
    assert abs(ours - theirs) <= REL * max(abs(theirs), 1e-12), f"{what}: {ours} vs {theirs}"


def _config(loss="forward_kl", beta=0.5, temperature=1.0, alpha=1.0, top_k=None):
    return SimpleNamespace(loss=loss, beta=beta, temperature=temperature, alpha=alpha, top_k=top_k)


def _ours(b, dc):
    """Our mean loss over the counted tokens and the student LM head's gradient of it."""
    w = b.student.lm_head.weight.detach().clone().requires_grad_(True)
    loss, metrics = distill_loss_sum(b.hs_s @ w.T, b.hs_t @ b.teacher.lm_head.weight.T, b.labels, dc)
    mean = loss / metrics["tokens"]
    mean.backward()
    return mean.detach(), w.grad


def _trl_distillation(b, trl_beta, temperature):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    w = b.student.lm_head.weight.detach().clone().requires_grad_(True)
    loss, _, _ = _chunked_divergence_loss(
        b.hs_s, b.hs_t, w, b.teacher.lm_head.weight.detach(), b.mask.long(), trl_beta, temperature=temperature
    )
    loss.backward()
    return loss.detach(), w.grad


CASES = [("forward_kl", 0.5, 1.0), ("reverse_kl", 0.5, 1.0), ("jsd", 0.5, 1.0), ("jsd", 0.1, 2.0),
         ("jsd", 0.9, 0.7), ("forward_kl", 0.5, 2.0), ("reverse_kl", 0.5, 0.5)]  # fmt: skip


@pytest.mark.parametrize("loss, beta, temperature", CASES)
def test_equals_trl_distillation_trainer_and_gkd(batch, loss, beta, temperature):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    dc = _config(loss, beta, temperature)
    trl_beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(loss, beta)
    ours, our_grad = _ours(batch, dc)
    theirs, their_grad = _trl_distillation(batch, trl_beta, temperature)
    assert float(theirs) > 0.05  # a divergence of order 1, where fp32 rounding is not the whole difference
    _close(ours, theirs, f"{loss} vs DistillationTrainer")
    assert (our_grad - their_grad).abs().max() <= GRAD_REL * their_grad.abs().max(), "student head gradient"
    with torch.no_grad():
        gkd = GKDTrainer.generalized_jsd_loss(
            batch.hs_s @ batch.student.lm_head.weight.T, batch.hs_t @ batch.teacher.lm_head.weight.T,
            labels=batch.labels, beta=trl_beta, temperature=temperature,
        )  # fmt: skip
    _close(ours, gkd, f"{loss} vs GKD generalized_jsd_loss")


def test_prompt_and_padding_are_not_counted(batch):
    """Changing the logits at uncounted positions changes nothing; at a counted one it does."""
    zs, zt = batch.hs_s @ batch.student.lm_head.weight.T, batch.hs_t @ batch.teacher.lm_head.weight.T
    base, metrics = distill_loss_sum(zs, zt, batch.labels, _config("jsd"))
    assert int(metrics["tokens"]) == int(batch.mask.sum()) == 3 * 11 - 3 * (PROMPT - 1) - PAD
    noisy = zs.clone()
    noisy[~batch.mask] += 5 * torch.randn_like(noisy[~batch.mask])
    assert float(distill_loss_sum(noisy, zt, batch.labels, _config("jsd"))[0]) == float(base)
    noisy[batch.mask.nonzero()[0].tolist()] += 1.0 * torch.randn(VOCAB)
    assert float(distill_loss_sum(noisy, zt, batch.labels, _config("jsd"))[0]) != float(base)


def _direct_top_k(zs, zt, mask, k, loss, beta, temperature):
    """The top-k divergence written out: gather the teacher's k best indices, log-softmax of both over them."""
    idx = zt.topk(k, dim=-1).indices
    ls = torch.log_softmax(zs.gather(-1, idx).double() / temperature, -1)
    lt = torch.log_softmax(zt.gather(-1, idx).double() / temperature, -1)
    ps, pt = ls.exp(), lt.exp()
    if loss == "forward_kl":
        d = (pt * (lt - ls)).sum(-1)
    elif loss == "reverse_kl":
        d = (ps * (ls - lt)).sum(-1)
    else:
        lm = torch.log(beta * pt + (1 - beta) * ps)
        d = beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * (ps * (ls - lm)).sum(-1)
    return d[mask].sum() / mask.sum()


@pytest.mark.parametrize("loss, beta, temperature, k", [("forward_kl", 0.5, 1.0, 5), ("reverse_kl", 0.5, 2.0, 8),
                                                         ("jsd", 0.3, 1.0, 1), ("jsd", 0.7, 0.5, 40)])  # fmt: skip
def test_top_k_equals_a_direct_computation(batch, loss, beta, temperature, k):
    zs, zt = batch.hs_s @ batch.student.lm_head.weight.T, batch.hs_t @ batch.teacher.lm_head.weight.T
    loss_sum, metrics = distill_loss_sum(zs, zt, batch.labels, _config(loss, beta, temperature, top_k=k))
    want = _direct_top_k(zs, zt, batch.mask, k, loss, beta, temperature)
    _close(loss_sum / metrics["tokens"], want, f"top_k={k} {loss}")
    if k == 1:
        assert float(loss_sum) == 0.0  # one token left: both renormalised distributions are that token


def test_top_k_keeps_exactly_k_without_ties_and_all_ties_at_the_kth():
    z = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 3.0, 3.0, 0.0, 2.0]])
    support = teacher_support(z, 2)
    assert support[0].tolist() == [False, True, False, True, False]
    assert support[1].tolist() == [False, True, True, False, False]
    assert teacher_support(z, 3)[1].tolist() == [False, True, True, False, True]


def test_top_k_equal_to_the_vocabulary_is_the_full_divergence(batch):
    zs, zt = batch.hs_s @ batch.student.lm_head.weight.T, batch.hs_t @ batch.teacher.lm_head.weight.T
    full = token_divergence(zs, zt, "jsd", 0.4, 1.5)
    kept = token_divergence(zs, zt, "jsd", 0.4, 1.5, top_k=VOCAB)
    assert torch.allclose(full, kept, rtol=1e-6, atol=0)


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.8])
def test_alpha_mixes_the_divergence_with_cross_entropy(batch, alpha):
    """alpha * TRL's divergence + (1 - alpha) * transformers' own token-mean cross-entropy of the student."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    zs, zt = batch.hs_s @ batch.student.lm_head.weight.T, batch.hs_t @ batch.teacher.lm_head.weight.T
    loss_sum, metrics = distill_loss_sum(zs, zt, batch.labels, _config("jsd", 0.5, 2.0, alpha=alpha))
    with torch.no_grad():
        kd = GKDTrainer.generalized_jsd_loss(zs, zt, labels=batch.labels, beta=0.5, temperature=2.0)
        ce = F.cross_entropy(zs.flatten(0, 1), batch.labels.flatten(), ignore_index=-100)
    _close(loss_sum / metrics["tokens"], alpha * kd + (1 - alpha) * ce, f"alpha={alpha}")
    assert math.isclose(float(metrics["ce_sum"]) / int(metrics["tokens"]), float(ce), rel_tol=REL) or alpha == 1
