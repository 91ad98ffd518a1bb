"""The preference step (train/preference_step.py) on every layout it runs on equals one process: DPO with three loss
types at once (sigmoid, ipo, sft: per-pair terms, per-length terms and a token mean) against a frozen copy of the
starting weights, at dp2 (with accumulation), FSDP, tp2 (with sequence parallelism and accumulation), cp2 (each
pair's log-probs summed over the ranks, with accumulation), ep2 on the MoE model, and LoRA against the adapters-off
reference at dp2 and tp2; SimPO and ORPO (no reference) at dp2 and pp2 (1F1B); KTO (its KL estimate over the global
batch) at dp2 with accumulation, tp2 and cp2 with accumulation. Loss, gradient norm, TRL's rewards and
log-probs of every step and the validation loss within 1e-5 relative (fp32). All cases in ONE 2-process launch
(tests/dist/preference_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DIST, FP32_RTOL, ROOT, TORCHRUN, torchrun_env

sys.path.insert(0, str(DIST))
import harness  # noqa: E402

SPECS = [
    "dp2:dpo",
    "dp2_accum:dpo",
    "fsdp2:dpo",
    "tp2:dpo",
    "tp2_sp_accum:dpo",
    "cp2:dpo",
    "cp2_accum:dpo",
    "fsdp2_ep2:dpo_moe",
    "dp2:dpo_lora",
    "tp2:dpo_lora",
    "dp2:simpo",
    "pp2_1f1b:simpo",
    "dp2:orpo",
    "pp2_1f1b:orpo",
    "dp2_accum:kto",
    "tp2:kto",
    "cp2_accum:kto",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pref") / "r.json"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DIST / "preference_worker.py"), str(out), *SPECS]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=torchrun_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(Path(out).read_text())


def _differences(mine: list, ref: list, is_eval: bool, variant: str) -> list[str]:
    """Loss, gradient norm (auxiliary losses) and log-probs within 1e-5 relative; the rewards, beta x (logp - ref
    logp), a difference of two sums near -70 that nearly cancel, within 1e-5 of the log-probs they come from."""
    n = 0 if is_eval else len(harness.PREFERENCE_METRICS)
    plain = [*mine[: len(mine) - n], *mine[len(mine) - 2 :]] if n else mine
    plain_ref = [*ref[: len(ref) - n], *ref[len(ref) - 2 :]] if n else ref
    out = [f"{a} vs {b}" for a, b in zip(plain, plain_ref) if abs(a - b) > FP32_RTOL * abs(b)]
    if n:
        beta = float(harness.PREFERENCE_VARIANTS[variant]["preference_config.beta"])
        scale = beta * max(abs(ref[-1]), abs(ref[-2]))
        rewards = list(zip(mine[-n:-2], ref[-n:-2]))  # chosen, rejected, accuracies
        out += [f"reward {a} vs {b}" for a, b in rewards if abs(a - b) > FP32_RTOL * scale]
    return out


def test_every_layout_equals_one_process(results):
    variants = sorted({s.split(":")[1] for s in SPECS})
    reference = {v: harness.run_case(None, v, world_size=1)[0] for v in variants}
    bad = []
    for spec in SPECS:
        got, want = results[spec], reference[spec.split(":")[1]]
        assert len(got) == len(want) == harness.STEPS + 1, spec
        for step, (mine, ref) in enumerate(zip(got, want), 1):
            assert len(mine) == len(ref), (spec, step)
            found = _differences(mine, ref, step > harness.STEPS, spec.split(":")[1])
            bad += [f"{spec} step {step}: {m}" for m in found]
    assert not bad, "\n".join(bad)
    dpo = reference["dpo"]
    assert all(len(step) == 2 + len(harness.PREFERENCE_METRICS) for step in dpo[:-1])  # the metrics are there
    assert dpo[0][2] == 0.0 and dpo[-2][2] != 0.0  # rewards/chosen: zero at the start, then the policy moves
