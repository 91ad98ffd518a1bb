"""train/frozen_model.py FrozenModel in one process: when it frees its FSDP-gathered weights (`ModelParts.reshard`,
counted here; under data parallelism the gathers themselves: tests/parity/test_distill_layouts.py), and that its
forward is the model's own, in eval mode, without a graph."""

from __future__ import annotations

import contextlib

import torch

from meshformer.config import load_config
from meshformer.parallel import init_parallel
from meshformer.train.frozen_model import FrozenModel
from meshformer.train.step import build_parts

MODEL = {
    "model.model_config.hidden_size": 32,
    "model.model_config.num_layers": 2,
    "model.model_config.num_heads": 4,
    "model.model_config.n_kv_heads": 2,
    "model.model_config.intermediate_size": 64,
    "model.model_config.vocab_size": 64,
    "model.model_config.seq_length": 8,
}
N_MICRO = 4


def _parts():
    cfg = load_config(None, [x for k, v in MODEL.items() for x in (f"--{k}", str(v))])
    return build_parts(cfg, init_parallel(cfg, 1)).parts


def _counting(frozen: FrozenModel, monkeypatch) -> list[int]:
    """The micro-batches left each time `frozen` frees its gathered weights."""
    freed = []
    monkeypatch.setattr(frozen.parts, "reshard", lambda: freed.append(frozen.micro_batches_left))
    return freed


def test_inside_the_loss_its_gathered_weights_are_freed_once_a_step(monkeypatch):
    """A teacher without pipeline parallelism: the step announces its micro-batches, the weights are freed after
    the last of them only; a call no step announced frees them too. map_logits frees them once, after its pass."""
    frozen = FrozenModel.frozen(_parts())
    freed = _counting(frozen, monkeypatch)
    inputs = torch.randint(64, (2 * N_MICRO, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # two steps
        frozen.expect_micro_batches(N_MICRO)
        for x in inputs.chunk(N_MICRO):
            frozen.micro_batch_logits(x, None)
        assert freed[-1] == 0
    assert freed == [0, 0]
    frozen.micro_batch_logits(inputs[:2], None)
    assert len(freed) == 3
    frozen.map_logits(inputs, None, N_MICRO, lambda logits, i: None)
    assert len(freed) == 4


def test_its_forward_is_the_models_in_eval_mode_without_a_graph(monkeypatch):
    """micro_batch_logits and map_logits give the model's logits, computed in eval mode, without a graph; the
    policy's own parts (a reference with adapters off) go back to training after and are never freed by it."""
    parts = _parts()
    model = parts.parts[0]
    x = torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    modes = []
    model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    policy = FrozenModel(parts, contextlib.nullcontext)  # not its own weights: the policy's backward frees them
    freed = _counting(policy, monkeypatch)
    parts.train(True)
    got = policy.micro_batch_logits(x, None)
    mapped = policy.map_logits(x, None, 1, lambda logits, i: logits)[0]
    assert modes == [False, False] and model.training and freed == []
    for logits in (got, mapped):
        assert not logits.requires_grad
        torch.testing.assert_close(logits, want, rtol=0, atol=0)
