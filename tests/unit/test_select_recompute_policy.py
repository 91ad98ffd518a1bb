"""select_recompute_policy (parallel/recompute.py): both policies give the gradients of no recompute, and
alternate_matmuls (torchtitan's op-level SAC) keeps every other linear's output and recomputes the rest."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT, refused
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.models.activations import kept_matmul
from meshformer.models.init import create_model
from meshformer.parallel.recompute import KEPT_LISTENERS, LINEAR_MATMULS, apply_recompute

MODEL = {
    "model.model_config.hidden_size": 64,
    "model.model_config.num_layers": 3,
    "model.model_config.num_heads": 4,
    "model.model_config.n_kv_heads": 2,
    "model.model_config.intermediate_size": 96,
    "model.model_config.vocab_size": 128,
    "model.model_config.seq_length": 32,
}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket in LINEAR_MATMULS
        return func(*args, **(kwargs or {}))


def _step(model, tokens, labels, policy):
    """(loss, gradients by name, tensors the selective layers kept, linear matmuls run in backward)."""
    model = copy.deepcopy(model)
    if policy is not None:
        apply_recompute(model, False, 0, True, select_policy=policy)
    kept = []
    KEPT_LISTENERS.append(kept.append)
    try:
        logits = model(tokens)
    finally:
        KEPT_LISTENERS.remove(kept.append)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    with _CountMatmuls() as counter:
        loss.backward()
    grads = {k.replace("_checkpoint_wrapped_module.", ""): p.grad for k, p in model.named_parameters()}
    return loss.detach(), grads, len(kept), counter.calls


def test_kept_matmul_alternates_from_the_first():
    assert [kept_matmul("alternate_matmuls", i) for i in range(7)] == [True, False] * 3 + [True]
    assert all(kept_matmul("matmuls", i) for i in range(7))


@pytest.mark.parametrize("policy", ["matmuls", "alternate_matmuls"])
def test_selective_policies_give_the_gradients_of_no_recompute(policy):
    cfg = load_config(None, [x for k, v in MODEL.items() for x in (f"--{k}", str(v))])
    mc = cfg.model.model_config
    model = create_model(mc, seed=0)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(mc.vocab_size, (2, mc.seq_length), generator=g)
    labels = torch.randint(mc.vocab_size, (2, mc.seq_length), generator=g)
    ref_loss, ref_grads, _, ref_calls = _step(model, tokens, labels, None)
    loss, grads, kept, calls = _step(model, tokens, labels, policy)
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        assert torch.allclose(grads[name], want, rtol=1e-6, atol=1e-7), name
    layers = mc.num_layers
    _, _, every_kept, every_calls = _step(model, tokens, labels, "matmuls")
    assert every_calls == ref_calls  # keeping every matmul recomputes none
    # a Llama layer runs 7 linear matmuls (q, k, v, o, gate, up, down): alternate_matmuls keeps 4 and runs the
    # other 3 again in backward
    recomputed = 3 if policy == "alternate_matmuls" else 0
    assert calls == ref_calls + recomputed * layers
    assert kept == every_kept - recomputed * layers


def test_an_unknown_policy_is_one_line(capsys):
    rc = main(
        [
            "config",
            "check",
            str(ROOT / "tests" / "empty.yaml"),
            "--recompute_config.select_recompute_policy",
            "alternate",
        ]
    )
    refused(capsys, rc, "select_recompute_policy='alternate'", "did you mean 'alternate_matmuls'")


def test_the_planner_adds_the_recomputed_matmuls_flops():
    """alternate_matmuls runs k, o and up again in backward: the plan's hardware FLOPs grow by their forward,
    the model FLOPs (MFU's numerator) do not; `matmuls` recomputes no matmul."""
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.accelerators import ACCELERATORS
    from meshformer.planner.plan import make_plan

    plans = {}
    for policy in ("none", "matmuls", "alternate_matmuls"):
        extra = {} if policy == "none" else {"recompute_config.select_recompute": True}
        extra |= {"recompute_config.select_recompute_policy": policy} if policy != "none" else {}
        cfg = load_config(None, [x for k, v in {**MODEL, **extra}.items() for x in (f"--{k}", str(v))])
        plans[policy] = make_plan(cfg, ParallelDims.from_config(cfg, 1), ACCELERATORS["H100"], 2, 1).throughput
    mc = cfg.model.model_config
    h, f, q, kv = mc.hidden_size, mc.ffn_hidden_size, mc.num_heads * mc.dim_per_head, mc.num_kv_heads * mc.dim_per_head
    tokens = 2 * mc.seq_length
    recomputed = 2 * (h * kv + q * h + h * f) * mc.num_layers * tokens
    none, every, alternate = plans["none"], plans["matmuls"], plans["alternate_matmuls"]
    assert every.hardware_flops_per_step == none.hardware_flops_per_step
    assert alternate.hardware_flops_per_step == pytest.approx(none.hardware_flops_per_step + recomputed, rel=1e-12)
    assert alternate.flops_per_step == none.flops_per_step
    assert alternate.tokens_per_s < every.tokens_per_s
