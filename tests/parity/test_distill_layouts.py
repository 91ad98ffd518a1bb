"""The distillation step (train/distill_step.py) with its teacher (train/distill_teacher.py) on every layout it runs on
equals one process: the parity model (a Llama) learns from a Mistral teacher of another width and depth, built and
parallelized as the student: dp2 with accumulation, FSDP, tp2 (the divergence on vocab shards), tp2 with sequence
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
