"""The planner on Mixture-of-Experts models: parameter counts (total, active, experts per rank) against the built
model, the active-parameter FLOPs rule against a hand count, predicted memory against a real step's measured
bytes, the all-to-all figures of expert parallelism, and the doctor's advice on `expert_parallel`."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ROOT, tiny_overrides
from meshformer.config import load_config
from meshformer.models import build_model
from meshformer.models.registry import family_of
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.memory import plan_memory
from test_memory import compare  # the same tolerances: states 2%, activations 10%

MOE = {
    "model.model_config.moe_config.expert_num": 8,
    "model.model_config.moe_config.num_experts_chosen": 2,
    "model.model_config.moe_config.moe_intermediate_size": 32,
}
SHAPES = {
    "Mixtral": {"model.model_config.type": "MixtralConfig", **MOE},
    "Qwen3-MoE": {"model.model_config.type": "Qwen3MoeConfig", "model.model_config.use_qk_norm": True, **MOE},
    "Qwen2-MoE shared + gate": {
        "model.model_config.type": "Qwen2MoeConfig",
        "model.model_config.qkv_has_bias": True,
        "model.model_config.moe_config.shared_expert_intermediate_size": 48,
        "model.model_config.moe_config.shared_expert_gate": True,
        **MOE,
    },
    "DeepSeek-V3 shaped": {
        "model.model_config.type": "DeepseekV3Config",
        "model.model_config.num_layers": 3,
        "model.model_config.q_lora_rank": 24,
        "model.model_config.kv_lora_rank": 16,
        "model.model_config.qk_nope_head_dim": 8,
        "model.model_config.qk_rope_head_dim": 8,
        "model.model_config.v_head_dim": 16,
        "model.model_config.moe_config.shared_expert_num": 1,
        "model.model_config.moe_config.use_gating_sigmoid": True,
        "model.model_config.moe_config.topk_method": "noaux_tc",
        "model.model_config.moe_config.n_group": 2,
        "model.model_config.moe_config.topk_group": 1,
        "model.model_config.moe_config.routed_scaling_factor": 2.5,
        "model.model_config.moe_config.first_k_dense_replace": 1,
        **MOE,
    },
    "first layer dense": {
        "model.model_config.type": "Qwen3MoeConfig",
        "model.model_config.moe_config.first_k_dense_replace": 1,
        "model.model_config.num_layers": 3,
        **MOE,
    },
}
TINY = {
    "model.model_config.hidden_size": 64,
    "model.model_config.num_layers": 2,
    "model.model_config.num_heads": 4,
    "model.model_config.n_kv_heads": 2,
    "model.model_config.vocab_size": 256,
    "model.model_config.seq_length": 32,
    "model.model_config.intermediate_size": 96,
}


def _config(extra: dict):
    argv = [x for k, v in {**TINY, **extra}.items() for x in (f"--{k}", str(v))]
    return load_config(None, argv)


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_counts_equal_the_built_model(name):
    cfg = _config(SHAPES[name])
    mc = cfg.model.model_config
    fam = family_of(mc)
    with torch.device("meta"):
        model = build_model(mc)
    params = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    assert fam.param_count(mc) == sum(p.numel() for p in params.values())
    m = mc.moe_config
    # hand count: a token goes through k of the E experts of each sparse layer, everything else whole
    assert routed == sum(mc.is_moe_layer(i) for i in range(mc.num_layers)) * 3 * 8 * 64 * 32
    assert fam.active_param_count(mc) == fam.param_count(mc) - routed + routed * m.num_experts_chosen // m.expert_num


def test_flops_per_token_counts_active_parameters_by_hand():
    cfg = _config(SHAPES["Qwen3-MoE"])
    mc = cfg.model.model_config
    h, L, s, V = 64, 2, 32, 256
    attn = h * 4 * 16 + 2 * h * 2 * 16 + 4 * 16 * h + 2 * 16  # q, k, v, o and the q/k norms (head_dim 16)
    router, active_experts = 8 * h, 2 * 3 * h * 32  # every expert's logit; 2 of 8 experts
    layer = attn + router + active_experts + 2 * h  # and the two norms
    matmul = L * layer + h + V * h  # + the final norm and the untied head (the input embedding is a lookup)
    assert family_of(mc).flops_per_token(mc) == 6 * matmul + 12 * L * 4 * 16 * s
    # the planner uses this one rule (the trainer's MFU asks the family directly)
    from meshformer.planner.throughput import flops_per_token

    assert flops_per_token(cfg) == 6 * matmul + 12 * L * 4 * 16 * s
    # latent attention: 6 L heads (qk + v) s for the scores and their weighted sum
    from meshformer.models.registry import model_config

    common = {k: v for k, v in vars(mc).items() if k not in ("type", "qkv_has_bias", "use_qk_norm")}
    latent = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
    mla = model_config(type="DeepseekV3Config", **common, **latent)
    assert family_of(mla).flops_per_token(mla) - 6 * family_of(mla).active_param_count(mla) + 6 * V * h == (
        6 * L * 4 * (16 + 16) * s
    )


BF16 = "model.model_config.compute_dtype"
LORA = {
    "model.model_config.pet_config.pet_type": "lora",
    "model.model_config.pet_config.lora_rank": 4,
    "model.model_config.pet_config.target_modules": ".*q_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj",
}
RUNS = {
    "Qwen3-MoE fp32": SHAPES["Qwen3-MoE"],
    "Qwen2-MoE shared + gate, full recompute": {
        **SHAPES["Qwen2-MoE shared + gate"],
        "recompute_config.recompute": True,
    },
    "DeepSeek-V3 shaped (latent attention, shared expert, sigmoid + bias)": SHAPES["DeepSeek-V3 shaped"],
    "Qwen3-MoE, selective recompute": {**SHAPES["Qwen3-MoE"], "recompute_config.select_recompute": True},
    "Mixtral, first layer dense, bf16": {
        **SHAPES["Mixtral"],
        "model.model_config.moe_config.first_k_dense_replace": 1,
        "model.model_config.compute_dtype": "bfloat16",
    },
    # autocast casts the stacked expert weights in every forward: copies saved per micro-batch
    "Qwen3-MoE bf16, accumulation 2": {
        **SHAPES["Qwen3-MoE"],
        "model.model_config.compute_dtype": "bfloat16",
        "runner_config.gradient_accumulation_steps": 2,
    },
    # routers and routed experts frozen: they save no inputs for weight gradients; LoRA on the shared experts
    "Qwen2-MoE shared + gate, LoRA, bf16": {**SHAPES["Qwen2-MoE shared + gate"], **LORA, BF16: "bfloat16"},
    "DeepSeek-V3 shaped, LoRA, selective recompute": {
        **SHAPES["DeepSeek-V3 shaped"],
        **LORA,
        "recompute_config.select_recompute": True,
    },
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_tiny_moe_run_measures_what_the_planner_predicts(tiny_dataset, tmp_path, name):
    from meshformer.train.trainer import run_training

    extra = {"runner_config.stop_step": 2, "model.model_config.seq_length": 64, **RUNS[name]}
    extra |= {"model.model_config.hidden_size": 64, "model.model_config.intermediate_size": 96}
    cfg = load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra))
    last = run_training(cfg)
    report = json.loads((tmp_path / "run" / "memory.json").read_text())
    measured = {f"mem_{k.replace('optimizer', 'optim')}": v for k, v in report["0"].items() if k.endswith("_bytes")}
    for key in ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes", "mem_activations_bytes"):
        assert last[key] == measured[key] > 0
    batch, accum = cfg.train_dataset.batch_size, cfg.runner_config.gradient_accumulation_steps
    (predicted,) = plan_memory(cfg, ParallelDims.from_config(cfg, 1), batch, accum)
    assert predicted.activations_counted
    assert compare(last, predicted) == []
    # tighter than compare's 10%: the block is counted op by op (models/moe/activations.py); within 1% in every
    # case here (an autocast LoRA run's is the largest gap)
    got, want = last["mem_activations_bytes"], predicted.activations_bytes
    assert abs(want - got) <= 0.03 * got, (want, got)


# ---- expert parallelism: states, gathered weights, all-to-all ----------------------------------------------------

FSDP4 = {"parallel_config.data_parallel": 4, "parallel_config.optimizer_shard": True}
ROUTED = 2 * 3 * 8 * 64 * 32  # the tiny Qwen3-MoE's routed experts: 2 layers x (gate, up, down) x 8 x 64 x 32


def _plan(extra: dict, accelerator: str = "H100", nodes: int = 1):
    from meshformer.parallel.batch_plan import BatchPlan
    from meshformer.planner.accelerators import find_accelerator
    from meshformer.planner.plan import make_plan

    cfg = _config({**SHAPES["Qwen3-MoE"], **extra})
    pc = cfg.parallel_config
    dims = ParallelDims.from_config(cfg, pc.data_parallel * pc.model_parallel * pc.pipeline_stage)
    batch = BatchPlan.from_config(cfg, dims)
    return make_plan(cfg, dims, find_accelerator(accelerator), batch.micro_batch, batch.n_micro, nodes)


def test_expert_parallel_splits_the_experts_and_prices_the_all_to_all():
    fsdp, ep2, ep4 = (_plan({**FSDP4, "parallel_config.expert_parallel": n}) for n in (1, 2, 4))
    for plan, ep, efsdp in ((fsdp, 1, 4), (ep2, 2, 2), (ep4, 4, 1)):
        m = plan.moe
        assert (m.total_params, m.routed_params, m.moe_layers) == (
            family_of(plan.cfg.model.model_config).param_count(plan.cfg.model.model_config),
            ROUTED,
            2,
        )
        assert m.experts_per_rank == 8 // ep and plan.as_dict()["layout"]["expert_fsdp"] == efsdp
        assert m.routed_params_per_rank == ROUTED // 4  # ep x efsdp = the 4 sharding ranks either way
    # the states are cut four ways in all three (FSDP over 4, or ep x efsdp = 4): the same bytes
    assert fsdp.stages[0].memory.states_bytes == ep2.stages[0].memory.states_bytes == ep4.stages[0].memory.states_bytes
    # FSDP gathers two layers' weights; under ep4 an MoE layer's are its dense part and this rank's 2 experts
    per_layer = ROUTED // 2
    assert (
        fsdp.stages[0].fsdp_gathered_bytes - ep4.stages[0].fsdp_gathered_bytes == 2 * (per_layer - per_layer // 4) * 4
    )
    # all-to-all: dispatch + combine, forward + backward, of T k rows of h fp32 values per layer; 3/4 leave the rank
    mb, seq, k, h = fsdp.micro_batch, 32, 2, 64
    assert fsdp.throughput.ep_bytes == 0 and fsdp.moe.a2a_buffer_bytes == 0
    assert ep4.throughput.ep_bytes == 4 * 2 * fsdp.n_micro * mb * seq * k * h * 4 * 3 / 4
    assert ep4.moe.a2a_buffer_bytes == 2 * mb * seq * k * h * 4
    assert ep4.throughput.ep_s == ep4.throughput.ep_bytes / ep4.accelerator.intra_bw
    rc = _plan({**FSDP4, "parallel_config.expert_parallel": 4, "recompute_config.recompute": True})
    assert rc.throughput.ep_bytes == ep4.throughput.ep_bytes * 6 / 4  # a recomputed layer dispatches again
    # replicated data parallel keeps every expert on every rank
    ddp = _plan({"parallel_config.data_parallel": 4})
    assert ddp.moe.routed_params_per_rank == ROUTED and ddp.moe.experts_per_rank == 8


def _doctor(capsys, config: str, *argv) -> tuple[int, str]:
    from meshformer.cli.main import main

    capsys.readouterr()
    rc = main(["doctor", str(ROOT / "configs" / config), *argv])
    return rc, " ".join(capsys.readouterr().out.split())


def test_the_doctor_advises_on_expert_parallel(capsys):
    # Qwen3-30B-A3B with plain data parallelism: every rank holds all 128 experts' states
    rc, out = _doctor(capsys, "plan_qwen3_30b_a3b.yaml", "--parallel_config.optimizer_shard", "false")
    assert rc == 1 and "out of memory" in out
    assert "parallel_config.expert_parallel: 8 with optimizer_shard: true (each rank keeps 1/8 of the routed" in out
    assert "routed experts hold 432.0 GiB of parameters, gradients and optimizer states per rank (90% of" in out
    assert "keeps 16 experts of each layer per rank -> 69.9 GiB per rank, fits" in out
    # ep 8 over 8 single-device nodes: the all-to-all crosses the network
    rc, out = _doctor(capsys, "plan_qwen3_30b_a3b.yaml", "--nodes", "8", "--parallel_config.expert_parallel", "8")
    assert "expert parallelism's all-to-all moves 180.4 GB per rank and step over the network" in out
    assert "keep expert_parallel x model_parallel within a node (1 devices)" in out
    rc, out = _doctor(capsys, "plan_qwen3_30b_a3b.yaml", "--parallel_config.expert_parallel", "8")
    assert rc == 0 and "all-to-all moves" not in out and "routed experts hold" not in out


def test_plan_explains_the_moe_figures(capsys):
    from meshformer.cli.main import main

    capsys.readouterr()
    argv = ["plan", str(ROOT / "configs" / "plan_qwen3_30b_a3b.yaml"), "--parallel_config.expert_parallel", "8"]
    assert main([*argv, "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (its model card)
    assert "N_active = N - routed x (1 - k/E) = 30,532,122,624 - 28,991,029,248 x (1 - 8/128) = 3,353,032,704" in out
    assert "experts per rank = E / ep = 128 / 8 = 16" in out and "6 x (N_active - V*h)" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["expert_parallel"] == 8 and plan["moe"]["active_params"] == 3_353_032_704
    assert plan["communication_bytes_per_step"]["ep"] == plan["moe"]["a2a_bytes"] > 0
