"""The distillation step (train/distill_step.py) with its teacher (train/distill_teacher.py) on every layout it runs on
equals one process: the parity model (a Llama) learns from a Mistral teacher of another width and depth, built and
parallelized as the student: dp2 with accumulation, FSDP (and under ZeRO-3 with recompute and accumulation), tp2
(the divergence on vocab shards), tp2 with sequence
parallelism and accumulation, and pp2 under 1F1B, interleaved 1F1B and ZBV (the teacher's stages walked
forward-only, its logits on the student's last stage; ZBV puts the first and last stage on one rank). The
variant (harness.DISTILL_VARIANTS) uses every part of the loss: the JSD, a temperature, the teacher's top-k support
and the alpha mix with the cross-entropy. Loss, gradient norm, the logged mean divergence and cross-entropy of
every step and the validation loss within 1e-5 relative (fp32). All cases in ONE 2-process launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DIST, FP32_RTOL, ROOT, TORCHRUN, torchrun_env

sys.path.insert(0, str(DIST))
import harness  # noqa: E402

SPECS = [
    "dp2_accum:distill",
    "fsdp2:distill",
    "fsdp2_zero3_rc_accum:distill",
    "tp2:distill",
    "tp2_sp_accum:distill",
    "pp2_1f1b:distill",
    "pp2_interleaved_1f1b:distill",
    "pp2_zbv_zero_bubble:distill",
]
# The teacher: another family and shape than harness.MODEL, its vocabulary; 4 layers, so ZBV's 4 stages hold one each
TEACHER = dict(
    vocab_size=harness.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    import torch
    import transformers

    out = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(5)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TEACHER))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked distributions: a divergence well above rounding
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def results(teacher, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("distill") / "r.json"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DIST / "parity_worker.py"), str(out), *SPECS]
    env = {**torchrun_env(), harness.DISTILL_TEACHER_ENV: str(teacher)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(Path(out).read_text())


def test_every_layout_equals_one_process(results, teacher, monkeypatch):
    monkeypatch.setitem(os.environ, harness.DISTILL_TEACHER_ENV, str(teacher))
    want = harness.run_case(None, "distill", world_size=1)[0]
    assert len(want) == harness.STEPS + 1
    assert all(len(step) == 4 for step in want[:-1])  # loss, grad norm, divergence, cross-entropy
    assert min(step[2] for step in want[:-1]) > 0.02  # a divergence far above float32 rounding
    bad = []
    for spec in SPECS:
        got = results[spec]
        assert len(got) == len(want), spec
        for step, (mine, ref) in enumerate(zip(got, want), 1):
            assert len(mine) == len(ref), (spec, step)
            bad += [f"{spec} step {step}: {a} vs {b}" for a, b in zip(mine, ref) if abs(a - b) > FP32_RTOL * abs(b)]
    assert not bad, "\n".join(bad)


def test_planner_predicts_the_teachers_memory_on_every_layout(results, teacher, monkeypatch):
    """The memory meter's figures of every rank of the launch above against the planner (tests/cli/
    test_distill_memory.py: the same in one process, with the teacher's logits and forward peak): the student's
    states and activations (the JSD's saved tensors in them; 10%), the teacher's weights split as the student's
    (2%), and under pipeline parallelism the logits its pass leaves for the loss: all the step's micro-batches',
    float32 with the labels, on the rank holding the last stage (ZBV's first), none on the other (2%). Not held:
    its logits without pipeline parallelism (on data-parallel ranks the meter's count of what the forward leaves
    alive includes the teacher's FSDP-gathered weights, which stay gathered: docs/posttraining.md; under tensor
    parallelism it does not see the vocab-sharded DTensor returned), and ZBV's activations on the rank holding the
    last stage, where the planner keeps the divergence's saved tensors to each micro-batch's weight step: an upper
    bound, within 25% of the measured peak."""
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.accelerators import cpu_accelerator
    from meshformer.planner.plan import make_plan
    from test_memory import STATES_RTOL, compare

    monkeypatch.setitem(os.environ, harness.DISTILL_TEACHER_ENV, str(teacher))
    bad, kept = [], {}
    for spec in SPECS:
        case, _ = spec.split(":")
        cfg = harness.variant_cfg("distill", case)
        dims, n_micro = ParallelDims.from_config(cfg, 2), harness.CASES[case][1]
        stages = make_plan(cfg, dims, cpu_accelerator(), harness.GLOBAL_BATCH // dims.dp // n_micro, n_micro).stages
        for rank in range(2):
            measured = results[f"{spec}:memory:{rank}"]
            stage = stages[measured["stage"]]
            found = compare(measured, stage.memory)
            if "zbv" in case and stage.second.logits_bytes:  # the rank holding the last stage
                found = [b for b in found if not b.startswith("activations_bytes")]
                got, bound = measured["mem_activations_bytes"], stage.memory.activations_bytes
                if not got <= bound <= 1.25 * got:
                    found.append(f"activations: {bound:,} is no bound within 25% of the measured {got:,}")
            figures = [("mem_teacher_bytes", stage.second.weights_bytes)]
            if dims.pp > 1:
                figures.append(("mem_teacher_logits_bytes", stage.second.logits_bytes))
            for key, want in figures:
                if abs(want - measured[key]) > STATES_RTOL * max(measured[key], 1):
                    found.append(f"{key}: predicted {want:,} measured {measured[key]:,}")
            bad += [f"{spec} rank {rank}: {b}" for b in found]
            kept[spec] = max(kept.get(spec, 0), measured["mem_teacher_logits_bytes"])
    assert not bad, "\n".join(bad)
    # 1F1B's last stage holds all 16 rows' logits (4 micro-batches of 4) with the labels, float32
    seq = harness.variant_cfg("distill", "pp2_1f1b").model.model_config.seq_length
    assert kept["pp2_1f1b:distill"] == 16 * seq * (harness.VOCAB + 1) * 4


def test_the_teacher_gathers_its_root_once_a_step(results):
    """Without pipeline parallelism the teacher runs inside the student's loss, one micro-batch at a time
    (train/frozen_model.py micro_batch_logits), and frees its FSDP-gathered weights once, after the step's last
    micro-batch: its root (embedding, final norm, head) is gathered once per step, not once per micro-batch. Its
    layers are gathered once per micro-batch where FSDP frees them after their forward (ZeRO-3), else once per step
    as the root. Every data-parallel spec of the launch above, every rank and step (tests/dist/gather_probe.py:
    a unit gathers when its forward starts with its weights sharded), and every unit sharded again after the step."""
    bad, probed = [], set()
    for spec in SPECS:
        overrides, n_micro = harness.CASES[spec.split(":")[0]]
        zero3 = overrides.get("recompute_config.parallel_optimizer_comm_recompute", False)
        for rank in range(2):
            steps = results[f"{spec}:memory:{rank}"]["teacher_gathers"]
            assert len(steps) == harness.STEPS, (spec, rank)
            for step, record in enumerate(steps, 1):
                gathers = record["gathers"]
                if not gathers:  # no FSDP unit: tensor or pipeline parallelism alone
                    continue
                probed.add(spec)
                want = {unit: n_micro if zero3 and unit != "root" else 1 for unit in gathers}
                if "root" not in gathers or gathers != want or not record["freed"]:
                    bad.append(f"{spec} rank {rank} step {step}: {record}, want gathers {want} and freed")
    # replicate with 4 micro-batches, FSDP with one, ZeRO-3 with 2: the root gathered once where it could be 4 or 2
    assert probed == {"dp2_accum:distill", "fsdp2:distill", "fsdp2_zero3_rc_accum:distill"}, probed
    assert not bad, "\n".join(bad)
