"""The planner's time for QLoRA's NF4 base (planner/nf4.py): every NF4 weight dequantized in each forward and
backward, a bandwidth-bound read of its NF4 bytes and write of the compute-dtype weight."""

from __future__ import annotations

import pytest

from meshformer.config import load_config
from meshformer.models.qlora import nf4_bytes
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import ACCELERATORS, find_accelerator
from meshformer.planner.plan import make_plan

M = "model.model_config."
# Llama 2 7B's shape, LoRA on every decoder linear, bf16 compute, two micro-batches of 2
LLAMA2_7B = {
    M + "hidden_size": 4096, M + "num_layers": 32, M + "num_heads": 32, M + "n_kv_heads": 32,
    M + "intermediate_size": 11008, M + "vocab_size": 32000, M + "compute_dtype": "bfloat16", M + "seq_length": 2048,
    M + "pet_method": "lora", M + "pet_config.lora_rank": 16,
    M + "pet_config.target_modules": "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    "train_dataset.batch_size": 2, "runner_config.gradient_accumulation_steps": 2,
}  # fmt: skip


def _plan(extra: dict, accelerator: str = "H200"):
    args = []
    for k, v in extra.items():
        args += [f"--{k}", str(v)]
    cfg = load_config(None, args)
    dims = ParallelDims.from_config(cfg, 1)
    batch = BatchPlan.from_config(cfg, dims)
    return make_plan(cfg, dims, find_accelerator(accelerator), batch.micro_batch, batch.n_micro, 1, None)


@pytest.mark.parametrize("recompute", [False, True])
def test_qlora_pays_the_nf4_dequantization_of_every_base_weight_per_pass(recompute):
    extra = {**LLAMA2_7B, "recompute_config.recompute": recompute}
    lora, qlora = _plan(extra), _plan({**extra, M + "pet_method": "qlora"})
    h, f = 4096, 11008
    shapes = [(h, h)] * 4 + [(f, h), (f, h), (h, f)]  # q, k, v, o; gate, up; down
    per_pass = 32 * sum(nf4_bytes(n, k) + n * k * 2 for n, k in shapes)  # NF4 read + bf16 write
    passes = 2 * (2 + recompute)  # 2 micro-batches x (forward, backward and a recomputed forward)
    expected = passes * per_pass / ACCELERATORS["H200"].hbm_bw
    assert qlora.throughput.nf4_dequant_s == pytest.approx(expected, rel=1e-12)
    assert qlora.throughput.compute_s - lora.throughput.compute_s == pytest.approx(expected, rel=1e-9)
    assert lora.throughput.nf4_dequant_s == 0.0
