"""Expert parallelism (parallel/expert_parallel.py) gives the single-process numbers, and bad layouts are one line.

The harness's MoE model (Qwen3-MoE-shaped: 8 routed experts, top-2, every layer sparse) trains 5 AdamW steps on
fixed tokens under ep2 / ep4, alone (ep = the FSDP ranks), with experts FSDP-sharded over what ep leaves (efsdp),
HSDP, tp2 (with and without sequence parallelism), pp2, recompute and accumulation, up to 8 processes; with the
balancing losses (global-batch, sequence-wise, z-loss) and the routing-bias update on as well, with LoRA on
attention and a dense layer's MLP, under bf16 autocast (bf16 bounds), and on a DeepSeek-V3-shaped model (latent
attention, shared expert, sigmoid routing with the score-correction bias, group-limited top-k, first layer dense;
also under tp2 with and without sequence parallelism, pp2 and dp2 without ep).
Loss, grad norm, every auxiliary loss and every router bias must equal the in-process single-process run within
1e-5 (fp32). The routed-expert gradients themselves are compared tensor by tensor (pytorch/pytorch#160285 reports
them doubled under EP = 2), a checkpoint written at ep2 resumes at ep1 (two processes, and one) and ep4 with the
same numbers, and `meshformer launch` at ep2 writes the single process's metrics.jsonl.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DIST, EMPTY, FP32_RTOL, ROOT, TORCHRUN, fails, rel, torchrun_env

sys.path.insert(0, str(DIST))
import ep_worker  # noqa: E402
import harness  # noqa: E402

WORLD2 = [
    "fsdp2_ep2:moe",
    "fsdp2_ep2_rc_accum:moe",
    "fsdp2_ep2_sel:moe",
    "fsdp2_ep2:moe_bal",
    "fsdp2_ep2_rc_accum:moe_bal",
    # latent attention's heads under tp2 (with sequence parallelism, accumulation, recompute), its layers over pp2
    "tp2:deepseek_v3",
    "tp2_sp_accum:deepseek_v3",
    "tp2_sp_rc:deepseek_v3",
    "fsdp2_ep2:deepseek_v3",
    "pp2_1f1b:deepseek_v3",
    "dp2_rc_accum:deepseek_v3",
    # GPT-OSS: biased router and experts (the biases sharded with their experts), sinks, alternating windows
    "fsdp2_ep2:gpt_oss",
    "fsdp2:gpt_oss",
    "tp2:gpt_oss",
    "tp2_sp_accum:gpt_oss",
    "pp2_1f1b:gpt_oss",
]
WORLD4 = [
    "fsdp4_ep4:moe",
    "fsdp4_ep2_accum:moe",
    "hsdp2x2_ep2:moe",
    "fsdp2xtp2_ep2:moe",
    "fsdp2xtp2_sp_ep2_sel:moe",
    "fsdp2xpp2_ep2:moe",
    "fsdp4_ep4:moe_bal",
    "hsdp2x2_ep2:moe_bal",
    "fsdp2xtp2_ep2:moe_bal",
    "fsdp2xpp2_ep2:moe_bal_seq",
    "fsdp4_ep2_accum:moe_lora",
    "fsdp2xtp2_ep2:moe_lora",
    "fsdp4_ep2_accum:moe_bf16",
    "fsdp4_ep4:moe_bf16",
    "fsdp4_ep4:deepseek_v3",
    "fsdp2xtp2_ep2:deepseek_v3",
    "fsdp2xpp2_ep2:deepseek_v3",
]
WORLD8 = [
    "fsdp8_ep4_accum:moe",
    "fsdp4xtp2_ep4_rc:moe",
    "fsdp2xtp2xpp2_ep2:moe",
    "fsdp8_ep4_accum:moe_bal",
    "fsdp2xtp2xpp2_ep2:moe_bal_seq",
]
BIAS_ATOL = 1e-7  # biases move by exact +-rate steps, centred: any differing sign flips one by ~rate
# bf16: test_parallel.py's bounds (one bf16 rounding is 2^-9 relative; the loss averages ~230 tokens' noise,
# the grad norm sums squares of bf16 matmul outputs), against the bf16 and the fp32 single process. Under expert
# parallelism an expert's grouped matmul sees another set of rows than in one process, rounding alike per row.
BF16_RTOL = {"loss": 1e-3, "grad_norm": 1e-2}


def _torchrun(nproc: int, script: str, args: list[str], timeout: int = 500) -> None:
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), str(DIST / script), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=torchrun_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]


def _parity(nproc: int, specs: list[str], out: Path) -> dict:
    _torchrun(nproc, "parity_worker.py", [str(out), *specs])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(one_process_run) -> dict:
    """Single-process runs of the MoE variants: per-step results and the routing biases after the run."""
    runs = {}
    for v in harness.MOE_VARIANTS:
        out, record = one_process_run(v)
        runs[v] = (out, record.get("router_biases", {}))
    return runs


def _check(results: dict, reference: dict, specs: list[str]) -> None:
    bad = []
    for spec in specs:
        case, variant = spec.split(":")
        got, (ref, ref_biases) = results[spec], reference[variant]
        assert len(got) == harness.STEPS + 1 and all(len(a) == len(b) for a, b in zip(got, ref)), spec
        if variant.startswith("moe_bal") or variant == "deepseek_v3":
            assert len(ref[0]) > 2, "the balancing variants report their auxiliary losses"
        refs = [ref, reference["moe"][0]] if variant == "moe_bf16" else [ref]
        for r in refs:
            for step, (row, ref_row) in enumerate(zip(got, r), 1):
                for what, a, b in zip(("loss", "grad_norm", "aux", "aux", "aux"), row, ref_row):
                    bound = BF16_RTOL.get(what, FP32_RTOL) if variant == "moe_bf16" else FP32_RTOL
                    if step == len(got) and what == "grad_norm":  # the eval row has no gradient
                        continue
                    if rel(a, b) > bound:
                        bad.append(f"{spec} step {step} {what}: {a} vs {b} (rel {rel(a, b):.2e})")
        biases = {
            k: v
            for key, rec in results.items()
            if key.startswith(f"{spec}:memory:")
            for k, v in rec.get("router_biases", {}).items()
        }
        assert set(biases) == set(ref_biases), spec  # every layer, from whichever stage holds it
        for name, values in ref_biases.items():
            worst = max(abs(a - b) for a, b in zip(biases[name], values))
            if worst > BIAS_ATOL:
                bad.append(f"{spec} {name}: bias differs by {worst:.2e}")
        if variant.startswith("moe_bal") or variant == "deepseek_v3":
            assert any(abs(v) > 0 for values in ref_biases.values() for v in values), "the biases moved"
    assert not bad, "\n".join(bad)


def _check_memory(results: dict, specs: list[str], world: int) -> None:
    """The planner (planner/memory.py) against what every rank of these runs measured (train/memory.py):
    parameters, gradients and optimizer states within 2% on each rank, saved activations within 10% averaged over
    the ranks of a pipeline stage. The planner assumes an even load; how many rows one rank's experts receive is
    the data's (a few percent either side of the mean here), so a single rank is not held to it."""
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.memory import plan_memory
    from test_memory import ACTIVATIONS_RTOL, compare

    bad = []
    for spec in specs:
        case, variant = spec.split(":")
        overrides, n_micro = harness.spec_of(case)
        cfg = harness.make_cfg({**harness.VARIANTS[variant], **overrides})
        dims = ParallelDims.from_config(cfg, world)
        stages = plan_memory(cfg, dims, harness.GLOBAL_BATCH // dims.dp // n_micro, n_micro)
        measured: dict[int, list[int]] = {}
        for rank in range(world):
            m = results[f"{spec}:memory:{rank}"]
            bad += [f"{spec} rank {rank}: {b}" for b in compare(m, stages[m["stage"]]) if "activations" not in b]
            measured.setdefault(m["stage"], []).append(m["mem_activations_bytes"])
        for stage, got in measured.items():
            mean, want = sum(got) / len(got), stages[stage].activations_bytes
            if abs(want - mean) > ACTIVATIONS_RTOL * mean:
                bad.append(f"{spec} stage {stage}: activations predicted {want:,}, measured {mean:,.0f} on average")
    assert not bad, "\n".join(bad)


# The checkpoint and expert-gradient jobs of test_expert_gradients_and_ep2_checkpoints_resuming_at_ep1_and_ep4, by
# world size; each runs in the launch of that world size's parity cases (ep_worker.py), after them.
EP_JOBS2 = ["save:fsdp2_ep2", "load:fsdp2", "grads:fsdp2_ep2"]
EP_JOBS4 = ["load:fsdp4_ep4", "load:hsdp2x2_ep2", "grads:fsdp4_ep2_accum", "grads:fsdp4_ep4"]


def _launch(nproc: int, specs: list[str], jobs: list[str], where: Path) -> dict:
    out = where / f"r{nproc}.json"
    _torchrun(nproc, "ep_worker.py", [str(out), str(where), *(f"parity:{s}" for s in specs), *jobs])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[dict, Path]:
    """(results of the 2-process launch: WORLD2's parity cases, then EP_JOBS2, the directory its files are in)."""
    where = tmp_path_factory.mktemp("ep")
    return _launch(2, WORLD2, EP_JOBS2, where), where


@pytest.fixture(scope="module")
def four_processes(two_processes) -> dict:
    """Results of the 4-process launch: WORLD4's parity cases, then EP_JOBS4 (loading the 2-process checkpoint)."""
    return _launch(4, WORLD4, EP_JOBS4, two_processes[1])


def test_ep_on_two_processes_equals_one_process(reference, two_processes):
    results = two_processes[0]
    _check(results, reference, WORLD2)
    _check_memory(results, WORLD2, 2)


def test_ep_with_fsdp_hsdp_tp_and_pp_on_four_processes_equals_one_process(reference, four_processes):
    _check(four_processes, reference, WORLD4)
    _check_memory(four_processes, WORLD4, 4)


def test_ep_on_eight_processes_equals_one_process(reference, tmp_path):
    results = _parity(8, WORLD8, tmp_path / "r8.json")
    _check(results, reference, WORLD8)
    _check_memory(results, WORLD8, 8)


def test_expert_gradients_and_ep2_checkpoints_resuming_at_ep1_and_ep4(two_processes, four_processes):
    """Expert gradients equal one process tensor by tensor (at ep2 alone, ep2 with efsdp2, ep4); a checkpoint saved
    at ep2 (experts split 4 + 4 per layer) resumes at ep1 (2 processes, and 1) and at ep4 and HSDP with ep2, every
    later step (loss, grad norm, aux losses) and the routing biases as the uninterrupted run."""
    two, where = two_processes
    got = {**two, **four_processes}  # the jobs' keys are "JOB:CASE[:what]", the parity cases' "CASE:VARIANT[:...]"
    one, _, _ = ep_worker.run("load", "single", where, world_size=1)
    got.update(one)
    assert got["save:fsdp2_ep2:local_experts"] == [4, 32, 64]  # each rank held half of every layer's experts
    saved = got["save:fsdp2_ep2"]
    for resumed in ("load:fsdp2", "load:single", "load:fsdp4_ep4", "load:hsdp2x2_ep2"):
        assert len(got[resumed]) == len(saved) == harness.STEPS - ep_worker.SAVED_AT
        for row, ref in zip(got[resumed], saved):
            assert all(rel(a, b) <= FP32_RTOL for a, b in zip(row, ref)), (resumed, row, ref)
        for name, values in got["save:fsdp2_ep2:biases"].items():
            assert max(abs(a - b) for a, b in zip(got[f"{resumed}:biases"][name], values)) <= BIAS_ATOL, resumed

    grads, _, _ = ep_worker.run("grads", "single", where, world_size=1)
    ref = _expert_grads_in_one_process(where)
    assert len(ref) == 3 * 4  # 4 layers x gate, up, down
    for case in ("fsdp2_ep2", "fsdp4_ep2_accum", "fsdp4_ep4"):
        dist = load_file(str(where / f"grads_{case}.safetensors"))
        assert set(dist) == set(ref), case
        for name, g in ref.items():
            scale = g.abs().max().item()
            assert scale > 0, name
            assert torch.allclose(dist[name], g, rtol=0, atol=1e-6 * scale), (case, name, (dist[name] - g).abs().max())
            assert not torch.allclose(dist[name], 2 * g, rtol=0, atol=1e-6 * scale)


def _expert_grads_in_one_process(where: Path) -> dict[str, torch.Tensor]:
    overrides = harness.VARIANTS[ep_worker.VARIANT]
    cfg = harness.make_cfg(overrides)
    from meshformer.parallel import init_parallel
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts

    env = init_parallel(cfg, 1)
    built = build_parts(cfg, env)
    probe = ep_worker.ExpertGrads(built.parts)
    harness.train_steps(built.parts, Optimizers(built.parts.parts, cfg), cfg, env, 1, range(1), hooks=[probe])
    return probe.grads


MOE = [a for k, v in harness.VARIANTS["moe"].items() for a in (f"--{k}", str(v))]
P = "--parallel_config."


@pytest.mark.parametrize(
    "flags, needles",
    [
        # a dense model has no experts to split
        ({"data_parallel": 2, "optimizer_shard": "true", "expert_parallel": 2}, ["dense", "expert_parallel: 1"]),
        # 8 experts do not split over 3 ranks
        (
            {"data_parallel": 3, "optimizer_shard": "true", "expert_parallel": 3, "moe": 1},
            ["expert_parallel=3 must divide moe_config.expert_num=8", "[1, 2, 4, 8]"],
        ),
        # ep borrows parameter-sharding data-parallel ranks: plain (replicated) data parallel has none
        (
            {"data_parallel": 2, "expert_parallel": 2, "moe": 1},
            ["expert_parallel=2 must divide the ranks it borrows", "= 1", "optimizer_shard: true"],
        ),
        # nor does tensor parallelism lend its ranks (experts stay whole on each tp rank)
        ({"model_parallel": 2, "expert_parallel": 2, "moe": 1}, ["ranks it borrows", "= 1"]),
        # four sharding ranks cannot hold ep = 8
        (
            {"data_parallel": 4, "optimizer_shard": "true", "expert_parallel": 8, "moe": 1},
            ["ranks it borrows", "= 4", "[1, 2, 4]"],
        ),
    ],
)
def test_bad_expert_parallel_layouts_are_one_line(capsys, flags, needles):
    flags = dict(flags)
    args = list(MOE) if flags.pop("moe", 0) else []
    for k, v in flags.items():
        args += [P + k, str(v)]
    world = flags.get("data_parallel", 1) * flags.get("model_parallel", 1)
    fails(capsys, ["config", "check", EMPTY, "--world-size", str(world), *args], *needles)


def test_cli_train_with_ep2_and_balancing_matches_one_process(tiny_dataset, tmp_path):
    """`meshformer launch` of a tiny MoE at ep2 (FSDP over 2 ranks) with global-batch and sequence balancing and the
    bias update: metrics.jsonl (loss, grad norm, eval loss, each auxiliary loss, the load imbalance) equals one
    process's, and the ep2 checkpoint resumes in one process."""
    from conftest import tiny_overrides

    e = "model.model_config.moe_config."
    common = {
        "model.model_config.type": "Qwen3MoeConfig",
        e + "expert_num": 4,
        e + "num_experts_chosen": 2,
        e + "moe_intermediate_size": 16,
        e + "aux_loss_types": "[global_batch, sequence]",
        e + "aux_loss_factors": "[0.01, 0.001]",
        e + "balance_via_topk_bias": "true",
        e + "topk_bias_update_rate": 0.01,
        "train_dataset.batch_size": 2,
        "do_eval": "true",
        "eval_config.eval_iters": 2,
        "eval_config.eval_interval": 3,
        "lr_schedule.total_steps": 6,
        "callbacks": "[{type: MFLossMonitor, per_print_times: 100}, "
        "{type: CheckpointMonitor, save_checkpoint_steps: 3}]",
    }
    one = {**common, "runner_config.gradient_accumulation_steps": 2, "runner_config.stop_step": 6}
    _cli(tmp_path, tiny_overrides(tiny_dataset, tmp_path / "one", one))
    ref = _metrics(tmp_path / "one")
    ep = {
        **common,
        "runner_config.stop_step": 3,
        "parallel_config.data_parallel": 2,
        "parallel_config.optimizer_shard": "true",
        "parallel_config.expert_parallel": 2,
    }
    _cli(tmp_path, tiny_overrides(tiny_dataset, tmp_path / "ep", ep), nproc=2)
    got = _metrics(tmp_path / "ep")
    keys = [k for k in ref[0] if k in ("loss", "grad_norm", "eval_loss") or k.startswith(("aux_loss/", "moe/"))]
    assert {"aux_loss/moe_global_batch", "aux_loss/moe_sequence", "moe/imbalance_max"} <= set(keys), keys
    _compare(got, ref[:3], keys)
    resumed = {**common, "runner_config.gradient_accumulation_steps": 2, "runner_config.stop_step": 6}
    _cli(tmp_path, tiny_overrides(tiny_dataset, tmp_path / "ep", {**resumed, "resume_training": "true"}))
    _compare(_metrics(tmp_path / "ep"), ref, keys)


def _cli(tmp_path: Path, overrides: list[str], nproc: int = 1) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_mode: train\n")
    via = [sys.executable, "-m", "meshformer", *(["launch", "--nproc", str(nproc)] if nproc > 1 else ["train"])]
    p = subprocess.run([*via, str(cfg), *overrides], capture_output=True, text=True, env=torchrun_env(), timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _compare(got: list[dict], ref: list[dict], keys: list[str]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for g, r in zip(got, ref):
        for key in keys:
            if key in r:
                assert rel(g[key], r[key]) <= FP32_RTOL, (key, g[key], r[key])
