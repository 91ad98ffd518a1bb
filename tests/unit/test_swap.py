"""Activation swap (swap_config): config checks and the planner everywhere; the offload itself on a GPU. Also the
layouts `compile: true` refuses."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import ACCELERATORS, cpu_accelerator
from meshformer.planner.plan import make_plan

MODEL = {
    "model.model_config.hidden_size": 256,
    "model.model_config.num_layers": 4,
    "model.model_config.num_heads": 4,
    "model.model_config.n_kv_heads": 2,
    "model.model_config.intermediate_size": 512,
    "model.model_config.vocab_size": 1024,
    "model.model_config.seq_length": 512,
}


def _cfg(**over):
    args = [x for k, v in {**MODEL, **over}.items() for x in (f"--{k}", str(v))]
    return load_config(None, args)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            ["--swap_config.op_swap", "[{op_name: flash_attention, backward_prefetch: 1, layers: true}]"],
            "use swap_config.layer_swap",
        ),
        (
            ["--swap_config.layer_swap", "[{layers: [0, 9]}]"],
            "layer_swap[0].layers=[0, 9]: give true or a list of layer",
        ),
        (["--swap_config.layer_swap", "[{layers: true, prefetch: 2}]"], "layer_swap[0]="),
        (["--swap_config.layer_swap", "[{layers: true, backward_prefetch: 0}]"], "backward_prefetch=0"),
        (["--swap_config.swap", "true", "--compile", "true"], "compile: true with swap_config.swap"),
    ],
)
def test_bad_swap_or_compile_config_is_one_line(capsys, extra, needle):
    capsys.readouterr()
    args = ["config", "check", str(ROOT / "tests" / "empty.yaml"), "--model.model_config.num_layers", "4"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


def test_planner_moves_swapped_activations_to_host():
    dims = ParallelDims.from_config(_cfg(), 1)
    h100 = ACCELERATORS["H100"]
    base = make_plan(_cfg(), dims, h100, 8, 1).stages[0]
    every = make_plan(_cfg(**{"swap_config.swap": "true"}), dims, h100, 8, 1).stages[0]
    some = _cfg(**{"swap_config.swap": "true", "swap_config.layer_swap": "[{layers: [1, 2], backward_prefetch: 1}]"})
    two = make_plan(some, dims, h100, 8, 1).stages[0]
    per_layer = every.memory.swapped_bytes // 4
    assert per_layer > 0 and two.memory.swapped_bytes == 2 * per_layer
    # the swapped layers' bytes leave the device, the layer in backward and the one prefetched come back
    assert base.memory.activations_bytes - every.memory.activations_bytes == 4 * per_layer
    assert base.memory.activations_bytes - two.memory.activations_bytes == 2 * per_layer
    assert every.memory.recompute_bytes == 2 * per_layer
    assert every.host_bytes == 4 * per_layer and every.allocated_bytes < base.allocated_bytes
    # a CPU run has nothing to swap to: the plan is the plan without swap
    cpu = cpu_accelerator(64e9)
    assert make_plan(_cfg(**{"swap_config.swap": "true"}), dims, cpu, 8, 1).stages[0].as_dict() == (
        make_plan(_cfg(), dims, cpu, 8, 1).stages[0].as_dict()
    )


def test_swap_refuses_recomputed_layers():
    from meshformer.models import build_model
    from meshformer.parallel.recompute import apply_recompute
    from meshformer.parallel.swap import apply_swap

    cfg = _cfg(**{"swap_config.swap": "true", "recompute_config.recompute": "true"})
    model = build_model(cfg.model.model_config)
    apply_recompute(model, True)
    with pytest.raises(UserError, match="layer 0 is also recomputed"):
        apply_swap(model, cfg.swap_config)
    fine = _cfg(**{"swap_config.swap": "true", "swap_config.layer_swap": "[{layers: [3]}]"})
    model = build_model(cfg.model.model_config)
    apply_recompute(model, [3])  # layers 0-2 recomputed, layer 3 swaps
    assert apply_swap(model, fine.swap_config) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="activation swap moves GPU memory to the host")
def test_swap_gives_the_same_steps_with_less_device_memory():
    from meshformer.parallel import init_parallel
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts, train_step

    runs = {}
    for mode, extra in {"none": {}, "swap": {"swap_config.swap": "true"}}.items():
        cfg = _cfg(**{"train_dataset.batch_size": 8, **extra})
        env = init_parallel(cfg, 1)
        built = build_parts(cfg, env)
        opt = Optimizers(built.parts.parts, cfg)
        g = torch.Generator(env.device).manual_seed(0)
        losses, peaks = [], []
        for _ in range(3):
            tok = torch.randint(1024, (8, 513), generator=g, device=env.device)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            res = train_step(
                built.parts, opt, env, tok[:, :-1], tok[:, 1:], n_micro=1, ignore_index=-100, max_grad_norm=1.0
            )
            torch.cuda.synchronize()
            losses.append(res.loss)
            peaks.append(torch.cuda.max_memory_allocated() - before)
        weights = [p.detach().clone() for p in built.parts.parameters()]
        runs[mode] = (losses, weights, peaks[-1], getattr(built.parts.parts[0], "activation_swap", None))
    (l0, w0, p0, _), (l1, w1, p1, swap) = runs["none"], runs["swap"]
    assert l0 == l1, (l0, l1)  # the same arithmetic on the same tensors: bit-identical
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert swap is not None and swap.offloaded_bytes > 0
    assert p1 < 0.75 * p0, (p1, p0)


def test_compile_auto_decides_by_device_layout_and_run_length(monkeypatch):
    """compile: auto compiles where it is proven and pays: always on a GPU without TP or swap, on a CPU only for a
    run whose work per process repays the compile (and never without a C++ compiler); true and false are obeyed."""
    from types import SimpleNamespace

    from meshformer.parallel.parallelize import CPU_COMPILE_MIN_FLOPS, compile_decision

    def env(device="cpu", tp=1, world=1, cp=1, ep=1):
        dims = SimpleNamespace(cp=cp, ep=ep)
        return SimpleNamespace(device=torch.device(device), tp_size=tp, world_size=world, dims=dims)

    auto, big = _cfg(), 2 * CPU_COMPILE_MIN_FLOPS
    assert compile_decision(auto, env("cuda"), None)[0]
    assert not compile_decision(auto, env("cuda", tp=2), big)[0]
    assert "context parallel" in compile_decision(auto, env("cuda", cp=2), big)[1]
    assert "expert parallelism" in compile_decision(auto, env("cuda", ep=2), big)[1]
    assert not compile_decision(_cfg(**{"swap_config.swap": True}), env("cuda"), big)[0]
    assert compile_decision(auto, env(), big) == (True, "compile: auto -> on (200 TFLOP per process)")
    on, why = compile_decision(auto, env(world=4), big)  # the work is per process: 50 TFLOP each
    assert not on and "50 TFLOP per process is under the 100 TFLOP" in why
    assert not compile_decision(auto, env(), None)[0]  # a run of unknown length (not the trainer's)
    assert compile_decision(_cfg(compile=True), env(), 0)[0]
    assert not compile_decision(_cfg(compile=False), env("cuda"), big)[0]
    monkeypatch.setattr("shutil.which", lambda name: None)
    on, why = compile_decision(auto, env(), big)
    assert not on and "no C++ compiler" in why
