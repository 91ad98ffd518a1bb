"""What a distillation run's loss holds on the last stage, per micro-batch, for the planner: the tensors the
divergence saves for the student's backward (in place of SFT's one log-softmax: activations), and the float32
temporaries it makes and frees beside them.

Which tensors autograd saves depends on the divergence, the alpha mix and top_k (train/distill_loss.py: forward_kl
keeps the student's log-probabilities and the teacher's probabilities; reverse_kl and jsd more; top_k a bool
support mask; alpha < 1 the cross-entropy's log-softmax), so they are counted, not written down: the run's own
`distill_loss_sum` runs on two small real batches of logits under train/memory.py's counters (saved-tensor hooks
for what is saved, the dispatch-mode counter for everything made), and the bytes are fitted as
tokens x (a x vocab + b), then scaled to the micro-batch's tokens and the rank's vocabulary shard. Under tensor
parallelism the loss runs on vocab-shard DTensors whose log-softmax is written out (an exp kept instead of the
log-softmax, the same bytes per element, plus a value per token): the unsharded count stands for it.
"""

from __future__ import annotations

import functools

from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE

_PROBE_TOKENS = 4


@functools.lru_cache(maxsize=64)
def _probe(loss: str, beta: float, temperature: float, alpha: float, top_k: int | None, dtype: str, vocab: int):
    """(saved bytes, peak bytes made) of one distill_loss_sum over _PROBE_TOKENS tokens of `vocab` logits."""
    import torch

    from meshformer.config.distill_schema import DistillConfig
    from meshformer.train.distill_loss import distill_loss_sum
    from meshformer.train.memory import ActivationCounter, ForwardCounter

    dc = DistillConfig(loss=loss, beta=beta, temperature=temperature, alpha=alpha, top_k=top_k)
    g = torch.Generator().manual_seed(0)
    shape = (1, _PROBE_TOKENS, vocab)
    student = torch.randn(shape, generator=g).to(DTYPE[dtype]).requires_grad_()
    teacher = torch.randn(shape, generator=g).to(DTYPE[dtype])
    labels = torch.randint(0, vocab, shape[:2], generator=g)
    saved, made = ActivationCounter(), ActivationCounter()
    with saved.hooks(), ForwardCounter(made):
        loss_sum, _ = distill_loss_sum(student, teacher, labels, dc)
    del loss_sum
    return saved.peak, made.peak


def _per_token(cfg: MeshformerConfig) -> tuple[tuple[float, float], tuple[float, float]]:
    """((a, b) saved, (a, b) made): bytes per token = a x vocab + b, fitted on two vocabulary sizes."""
    dc, mc = cfg.distill_config, cfg.model.model_config
    small = max(64, 2 * (dc.top_k or 0))
    args = (dc.loss, dc.beta, dc.temperature, dc.alpha, dc.top_k, mc.compute_dtype)
    one, two = _probe(*args, small), _probe(*args, 2 * small)
    fits = []
    for x1, x2 in zip(one, two):
        a = (x2 - x1) / (_PROBE_TOKENS * small)
        fits.append((a, x1 / _PROBE_TOKENS - a * small))
    return fits[0], fits[1]


def loss_saved_bytes(cfg: MeshformerConfig, tokens: int, vocab_shard: int) -> int:
    """What the loss saves for backward over `tokens` tokens of a `vocab_shard`-wide logit shard: the log-softmax
    in softmax_compute_dtype (the token cross-entropy, a preference loss's log-probabilities), or the divergence's."""
    if not cfg.distill_config.enabled:
        return tokens * vocab_shard * DTYPE[cfg.model.model_config.softmax_compute_dtype].itemsize
    (a, b), _ = _per_token(cfg)
    return int(tokens * (a * vocab_shard + b))


def loss_working_bytes(cfg: MeshformerConfig, tokens: int, vocab_shard: int) -> int:
    """The distillation loss's temporaries beyond what it saves (its peak of tensors made, less the saved)."""
    (a, b), (ma, mb) = _per_token(cfg)
    return max(0, int(tokens * ((ma - a) * vocab_shard + (mb - b))))
