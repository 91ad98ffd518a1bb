"""`meshformer doctor` on the seed's section-3.3 config: the impossible 1,200 samples/s with its FLOP/s arithmetic,
the out-of-memory triage in the seed's order with what each knob saves, a pipeline that keeps too many
micro-batches in flight, tensor parallelism across nodes."""

from __future__ import annotations

from conftest import ROOT
from meshformer.cli.main import main

SEED = str(ROOT / "configs" / "seed_pretrain_skeleton.yaml")
BF16 = ["--model.model_config.compute_dtype", "bfloat16"]


def doctor(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["doctor", SEED, *argv])
    return rc, " ".join(capsys.readouterr().out.split())  # rich wraps lines: compare with single spaces


def test_the_seeds_throughput_claim_and_memory_are_flagged_with_their_arithmetic(capsys):
    rc, out = doctor(capsys, "--target-samples-per-s", "1200")
    assert rc == 1
    # 1,200 x 2,048 tokens x 42.9 GFLOP/token (6N + 12 L h s for the 7B) = 105 PFLOP/s against 8 x H100
    assert "throughput target impossible: 1,200 samples/s x 2048 tokens x 42.9 GFLOP/token = 105.3 PFLOP/s" in out
    assert "7.92 PFLOP/s in bf16: 13x short even there" in out
    assert "out of memory: pipeline rank 0" in out
    order = [
        out.index(k)
        for k in (
            "train_dataset.batch_size: 2",
            "recompute_config.recompute: true",
            "parallel_config.optimizer_shard: true",
        )
    ]
    assert order == sorted(order)  # the seed's triage: micro batch, then recompute, then degrees
    assert "recompute_config.recompute: true: saves 57.4 GiB -> 36.0 GiB, fits" in out
    assert "pipeline bubble 11% (> 10%) with micro_batch_num 8 over 2 stages" in out


def test_a_pipeline_holding_every_micro_batch_is_told_to_hold_fewer(capsys):
    rc, out = doctor(
        capsys,
        *BF16,
        "--parallel_config.optimizer_shard",
        "true",
        "--parallel_config.pipeline_schedule",
        "gpipe",
        "--parallel_config.micro_batch_num",
        "16",
    )
    assert rc == 1 and "activations 291.0 for 16 micro-batch(es) in flight" in out
    assert "parallel_config.pipeline_schedule: 1f1b (GPipe keeps all 16 micro-batches in flight): saves" in out


def test_a_fitting_layout_and_tensor_parallel_across_nodes(capsys):
    rc, out = doctor(capsys, *BF16, "--parallel_config.optimizer_shard", "true")
    assert rc == 0 and "out of memory" not in out and "fits" in out
    rc, out = doctor(capsys, "--nodes", "8", *BF16, "--parallel_config.optimizer_shard", "true")
    assert rc == 0 and "model_parallel 2 spans nodes (1 devices per node)" in out


def test_plan_search_ranks_the_layouts_that_fit(capsys):
    import json

    capsys.readouterr()
    argv = ["plan", SEED, "--search", "--json", "--nodes", "2", *BF16]
    assert main(argv) == 0
    found = json.loads(capsys.readouterr().out)
    rows = found["fitting"]
    assert found["planned"] > 100 and 0 < len(rows) <= 10
    speeds = [r["tokens_per_s"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    for r in rows:
        assert r["model_parallel"] <= 4  # 8 devices on 2 nodes: tensor parallel stays inside a node
        assert r["data_parallel"] * r["model_parallel"] * r["pipeline_stage"] == 8
        per_step = r["micro_batch"] * r["gradient_accumulation_steps"] * r["data_parallel"]
        assert per_step * (r["micro_batch_num"] if r["pipeline_stage"] > 1 else 1) == 64  # the config's global batch
        assert r["reserved_bytes"] < 80e9


def test_plan_explain_substitutes_the_numbers(capsys):
    capsys.readouterr()
    assert main(["plan", SEED, "--explain", *BF16]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens per micro-batch T = micro batch 4 x seq_length 2048 = 8,192" in out
    assert "12 x 32 x 32 x 128 x 2048 = 42.87 GFLOP (causal not halved)" in out
    assert "(allocated - resident) x 1.200 (eager) = 68.08 GiB; + runtime 2.80 GiB" in out


def test_cpu_offload_moves_the_states_to_the_host_and_needs_sharding(capsys):
    import json

    capsys.readouterr()
    assert main(["plan", SEED, "--json", *BF16, "--parallel_config.optimizer_shard", "true"]) == 0
    kept = json.loads(capsys.readouterr().out)["stages"][0]
    assert (
        main(
            [
                "plan",
                SEED,
                "--json",
                *BF16,
                "--parallel_config.optimizer_shard",
                "true",
                "--parallel_config.cpu_offload",
                "true",
            ]
        )
        == 0
    )
    offloaded = json.loads(capsys.readouterr().out)["stages"][0]
    states = kept["params_bytes"] + kept["grads_bytes"] + kept["optimizer_bytes"]
    # on the host the update is fused AdamW over CPU tensors (torch has the kernel there): no temporaries
    assert offloaded["host_bytes"] == states
    assert offloaded["allocated_bytes"] == kept["allocated_bytes"] - states
    assert main(["plan", SEED, "--parallel_config.cpu_offload", "true"]) == 2
    err = capsys.readouterr().err
    assert "parallel_config.cpu_offload=true offloads FSDP's shards" in err and err.count("\n") == 1


def test_a_long_sequence_under_recompute_is_told_when_context_parallel_beats_it(capsys):
    """At 32k tokens the 16-layer model needs recompute on this layout; cp2 on half the data-parallel ranks fits with
    recompute off and saves its extra forward for a K/V all-gather: the doctor compares the two. At the seed's 2,048
    tokens the same layout gets no such advice."""
    long = [*BF16, "--parallel_config.optimizer_shard", "true", "--recompute_config.recompute", "true"]
    long += ["--model.model_config.num_layers", "16", "--train_dataset.batch_size", "1"]
    rc, out = doctor(capsys, *long, "--model.model_config.seq_length", "32768")
    assert "seq_length 32768 with recompute: parallel_config.context_parallel: 2, data_parallel: 1" in out, out
    assert "faster" in out and "K/V all-gather of 17.2 GB per step" in out
    rc, out = doctor(capsys, *long)
    assert "context_parallel: 2" not in out


def test_the_k_v_gathers_of_context_parallel_are_in_the_step_time():
    """Per attention layer and micro-batch a cp rank receives (cp-1)/cp of 2 x micro_batch x seq x kv_heads/tp x
    head_dim values when gathering, and sends as much back in backward: the planner's cp bytes, and they cost time."""
    import types

    from meshformer.cli.plan_cmd import build

    base = ["--model.model_config.compute_dtype", "bfloat16", "--model.model_config.seq_length", "8192"]
    args = types.SimpleNamespace(config=SEED, devices=None, nodes=1, accelerator="H100", device_memory=None)
    plans = {}
    for cp in (1, 2):
        args.overrides = [*base, "--parallel_config.context_parallel", str(cp), "--parallel_config.data_parallel", "1"]
        cfg, plans[cp] = build(args)
    mc, t = cfg.model.model_config, plans[2].throughput
    kv = 2 * plans[2].micro_batch * 8192 * (mc.num_kv_heads // 2) * mc.dim_per_head * 2
    assert t.cp_bytes == 2 * (mc.num_layers / 2) * plans[2].n_micro * kv / 2
    assert plans[1].throughput.cp_bytes == 0 and t.cp_s > 0
    assert plans[2].throughput.tp_bytes == plans[1].throughput.tp_bytes / 2  # a cp rank's tp traffic: its tokens


def test_a_lora_run_that_does_not_fit_is_offered_qlora(capsys):
    """Llama 2 7B LoRA over a bf16 base on a 16 GB card: 12.6 GiB of frozen weights; the NF4 base (QLoRA) fits."""
    capsys.readouterr()
    qlora = str(ROOT / "configs" / "llama2_7b_qlora_24gb.yaml")
    lora = ["--model.model_config.pet_config.quantize_base", "none", "--model.model_config.param_init_type", "bfloat16"]
    rc = main(["doctor", qlora, "--device-memory", "16", "--model.model_config.pet_method", "lora", *lora])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 1 and "out of memory: pipeline rank 0 needs 18.8 GiB of 14.9 GiB (weights 12.6" in out
    assert "model.model_config.pet_config.quantize_base: nf4 (QLoRA: the frozen base in 4 bits): saves 9.0 GiB" in out
    assert main(["plan", qlora, "--device-memory", "24"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "│ 0 │ 32 │ 4.24 │" in out and "fits" in out
