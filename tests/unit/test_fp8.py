"""FP8 linears (fp8_config): which linears convert and which stay, the planner's FP8 step time against the peaks
table, the doctor's offer, and torchtitan's published Llama 3.1 8B Float8 row.

The training itself (20 CPU steps against bf16; fsdp2 and tp2 against one process) is tests/cli/test_fp8_train.py
and tests/parity/test_fp8_parity.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshformer.backends.peaks import PEAKS
from meshformer.config import load_config
from meshformer.models import build_model
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.parallel.dims import ParallelDims
from meshformer.parallel.env import ParallelEnv
from meshformer.parallel.float8 import apply_float8, float8_choice, torchao_float8
from meshformer.planner.accelerators import ACCELERATORS, find_accelerator
from meshformer.planner.doctor import fp8_findings
from meshformer.planner.plan import make_plan

M = "model.model_config."
# Llama 3.1 8B as torchtitan's benchmark runs it: FSDP over 8 H100s (96 GB), local batch 2, seq 8192, selective
# activation checkpointing.
LLAMA31_8B = {
    M + "hidden_size": 4096, M + "num_layers": 32, M + "num_heads": 32, M + "n_kv_heads": 8,
    M + "intermediate_size": 14336, M + "vocab_size": 128256, M + "compute_dtype": "bfloat16", M + "seq_length": 8192,
    "parallel_config.data_parallel": 8, "parallel_config.optimizer_shard": True, "train_dataset.batch_size": 2,
    "recompute_config.select_recompute": True,
}  # fmt: skip
TORCHTITAN_FP8_TOKENS_PER_GPU = 8532  # benchmarks/llama3_h100_202412_torchtitan.md: compiled, Float8


def _cfg(extra: dict):
    args = []
    for k, v in extra.items():
        args += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return load_config(None, args)


def _plan(extra: dict, accelerator: str = "H100"):
    cfg = _cfg(extra)
    dims = ParallelDims.from_config(cfg, cfg.parallel_config.data_parallel * cfg.parallel_config.model_parallel)
    batch = BatchPlan.from_config(cfg, dims)
    return make_plan(cfg, dims, find_accelerator(accelerator), batch.micro_batch, batch.n_micro, 1, 103.08e9)


def test_the_decoder_linears_convert_and_the_rest_stay_listed_once():
    """q/k/v/o convert; the MLP's 72-wide linears cannot (FP8 kernels take multiples of 16) and the head and
    embedding are never candidates; a filter keeps a linear by name. The note names each kept shape once, not
    once per layer."""
    cfg = _cfg({M + "hidden_size": 64, M + "num_layers": 3, M + "num_heads": 4, M + "intermediate_size": 72,
                M + "vocab_size": 128, M + "compute_dtype": "bfloat16", "fp8_config.enable": True,
                "fp8_config.filter_fqns": "[o_proj]"})  # fmt: skip
    model = build_model(cfg.model.model_config)
    convert, kept = float8_choice(model, ["o_proj"])
    assert convert == [f"layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qkv"]
    assert kept["layers.1.mlp.down_proj"] == "64x72 is not a multiple of 16"
    assert kept["layers.2.self_attn.o_proj"] == "fp8_config.filter_fqns has 'o_proj'"
    note = apply_float8(model, cfg, ParallelEnv())
    assert note == (
        "fp8: 9 decoder linears in FP8 (tensorwise); kept in bf16: layers.*.self_attn.o_proj (fp8_config.filter_fqns "
        "has 'o_proj'), layers.*.mlp.gate_proj (72x64 is not a multiple of 16), layers.*.mlp.up_proj (72x64 is not "
        "a multiple of 16), layers.*.mlp.down_proj (64x72 is not a multiple of 16)"
    )
    float8_linear = torchao_float8().float8_linear.Float8Linear
    converted = {n for n, m in model.named_modules() if isinstance(m, float8_linear)}
    assert converted == set(convert)
    assert type(model.lm_head) is nn.Linear  # the output head stays in bf16


def test_a_converted_linear_computes_in_fp8_under_cpu_autocast():
    """Under CPU autocast a converted linear's output is the FP8 product (inputs and weight rounded to float8 with
    one scale each), not the bf16 one: the recipe really runs, and its backward meets bf16 on both sides."""
    torch.manual_seed(0)
    cfg = _cfg({M + "compute_dtype": "bfloat16", "fp8_config.enable": True, "fp8_config.recipe": "rowwise_with_gw_hp"})
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(64, 32, bias=False)})
    plain = nn.Linear(64, 32, bias=False)
    plain.weight.data.copy_(model.layers["0"].weight.data)
    apply_float8(model, cfg, ParallelEnv())
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y8, y16 = model.layers["0"](x), plain(x)
    assert y8.dtype == torch.bfloat16
    err = ((y8.float() - y16.float()).norm() / y16.float().norm()).item()
    # e4m3 keeps 4 significant bits: each rounding is up to 2^-4 relative (RMS 2^-4/sqrt(3)), so a product of two
    # rounded operands is off by a few percent; bf16 alone would be off by ~2^-8.
    assert 5e-3 < err < 0.1, err
    y8.float().sum().backward()
    assert model.layers["0"].weight.grad is not None and torch.isfinite(model.layers["0"].weight.grad).all()


def test_the_fp8_plan_takes_the_converted_matmuls_to_the_fp8_peak():
    """The FP8 plan's compute is the bf16 plan's minus the converted linears' matmul time at the bf16 peak, plus
    that time at the FP8 peak (both at gemm_efficiency), plus the casts at the HBM bandwidth (planner/fp8.py); the
    peaks are backends/peaks.py's data-sheet figures, one table."""
    bf16, fp8 = _plan(LLAMA31_8B), _plan({**LLAMA31_8B, "fp8_config.enable": True})
    acc = ACCELERATORS["H100"]
    assert acc.peak_fp8 == PEAKS["H100"].fp8 == 1978.9e12 and acc.peak_bf16 == PEAKS["H100"].bf16
    h, kv, f = 4096, 1024, 14336
    params = 32 * (2 * h * h + 2 * h * kv + 3 * h * f)  # every decoder linear: all multiples of 16
    assert fp8.throughput.fp8_share == pytest.approx(6 * params / bf16.throughput.flops_per_token)
    tokens_per_rank = 2 * 8192
    matmul = 6 * params * tokens_per_rank
    casts = (7 * 32 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + f)) * tokens_per_rank + 6 * params) / acc.hbm_bw
    saved = matmul / (acc.peak_bf16 * acc.gemm_efficiency) - matmul / (acc.peak_fp8 * acc.gemm_efficiency) - casts
    assert fp8.throughput.fp8_saved_s == pytest.approx(saved, rel=1e-9)
    assert fp8.throughput.compute_s == pytest.approx(bf16.throughput.compute_s - saved, rel=1e-9)
    assert fp8.throughput.mfu > bf16.throughput.mfu  # MFU stays against the bf16 peak, as torchtitan reports it
    # A100 has no FP8 units: the plan is bf16's
    a100, a100_fp8 = _plan(LLAMA31_8B, "A100"), _plan({**LLAMA31_8B, "fp8_config.enable": True}, "A100")
    assert a100_fp8.throughput.step_time_s == a100.throughput.step_time_s and a100_fp8.throughput.fp8_share == 0


def test_torchtitans_llama31_8b_float8_row_within_15_percent():
    """torchtitan's Llama 3.1 8B on 8 x H100 (96 GB), FSDP, local batch 2, seq 8192, selective AC, compiled,
    Float8: 8,532 tokens/s per GPU (tests/unit/test_published_runs.py holds the table it belongs to)."""
    plan = _plan({**LLAMA31_8B, "fp8_config.enable": True, "compile": True}, "H100-96GB")
    per_gpu = plan.throughput.tokens_per_s / 8
    assert abs(per_gpu / TORCHTITAN_FP8_TOKENS_PER_GPU - 1) < 0.15, per_gpu


def test_the_doctor_offers_fp8_on_a_compute_bound_hopper_run_only():
    h100 = _plan(LLAMA31_8B)
    (finding,) = fp8_findings(h100)
    assert "fp8_config.enable: true" in finding.text and "72% of the FLOPs" in finding.text
    assert not fp8_findings(_plan(LLAMA31_8B, "A100"))  # no FP8 units
    assert not fp8_findings(_plan({**LLAMA31_8B, "fp8_config.enable": True}))  # already on


def test_precomputed_fsdp_scales_run_after_each_optimizer_step_only_when_asked(monkeypatch):
    """The hook exists only for a run with precompute_float8_dynamic_scale_for_fsdp, and calls torchao's precompute
    on every model piece after the optimizer step (the FSDP FP8 all-gather itself needs NCCL: no CPU test)."""
    from types import SimpleNamespace

    from meshformer.train import float8_scales
    from meshformer.train.hooks import REGISTERED

    assert REGISTERED["float8_scales"] == float8_scales.Float8ScalesHook.for_run
    parts = SimpleNamespace(parts=[nn.Linear(16, 16), nn.Linear(16, 16)])
    fp8 = {M + "compute_dtype": "bfloat16", "fp8_config.enable": True}
    assert float8_scales.Float8ScalesHook.for_run(_cfg(fp8), parts) is None
    asked = _cfg({**fp8, "fp8_config.enable_fsdp_float8_all_gather": True,
                  "fp8_config.precompute_float8_dynamic_scale_for_fsdp": True})  # fmt: skip
    hook = float8_scales.Float8ScalesHook.for_run(asked, parts)
    seen = []
    monkeypatch.setattr(torchao_float8(), "precompute_float8_dynamic_scale_for_fsdp", seen.append)
    hook.after_optimizer_step(1)
    assert seen == parts.parts


def test_the_fp8_all_gather_gathers_the_converted_weights_at_one_byte():
    """FSDP2's FP8 all-gather (tensorwise, enable_fsdp_float8_all_gather) gathers a converted linear's weight in
    FP8: the plan's FSDP term (two layers' gathered weights) loses one byte per converted weight element of those two
    layers, everything else (norms, and the bf16 plan's other terms) unchanged."""
    fp8 = _plan({**LLAMA31_8B, "fp8_config.enable": True})
    gather = _plan({**LLAMA31_8B, "fp8_config.enable": True, "fp8_config.enable_fsdp_float8_all_gather": True})
    h, kv, f = 4096, 1024, 14336
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f  # a layer's converted linears
    (a,), (b,) = fp8.stages, gather.stages
    assert a.fsdp_gathered_bytes - b.fsdp_gathered_bytes == 2 * per_layer * (2 - 1)
    assert b.fsdp_gathered_bytes > 0 and a.memory == b.memory
    # without FSDP nothing is gathered, FP8 or not
    one = {**LLAMA31_8B, "parallel_config.data_parallel": 1, "parallel_config.optimizer_shard": False}
    assert (
        _plan({**one, "fp8_config.enable": True, "fp8_config.enable_fsdp_float8_all_gather": True})
        .stages[0]
        .fsdp_gathered_bytes
        == 0
    )


def test_a_biased_fp8_linear_under_tensor_parallelism_gets_the_unrounded_bias_gradient(tmp_path):
    """torchao's FP8 column style casts the output gradient to e5m2 after the module's bias add, so the bias gradient
    would be summed from FP8-rounded values; the style parallel/tp.py gives a biased tensorwise linear
    (parallel/float8.py float8_bias_styles) leaves that cast to the Float8Linear's matmul, as one process has it. On
    a one-rank mesh the sharding is trivial, so the style's own arithmetic is all that differs."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from meshformer.parallel.tp import make_style

    float8 = torchao_float8()
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        base, x = nn.Sequential(nn.Linear(64, 32)), torch.randn(4, 16, 64)
        config = float8.Float8LinearConfig(emulate=True)
        grads = {}
        for kind in ("one process", "tensorwise", "tensorwise_bias"):
            model = float8.convert_to_float8_training(copy.deepcopy(base), config=config)
            if kind != "one process":
                parallelize_module(model[0], mesh, make_style("colwise", False, kind))
            model(x).pow(2).sum().backward()
            bias = model[0].bias.grad
            grads[kind] = bias.full_tensor() if hasattr(bias, "full_tensor") else bias
    finally:
        if own:
            dist.destroy_process_group()
    ref = grads["one process"]
    assert torch.allclose(grads["tensorwise_bias"], ref, rtol=1e-6, atol=0)
    assert (grads["tensorwise"] - ref).norm() / ref.norm() > 1e-3  # torchao's own style: rounded to e5m2 first
