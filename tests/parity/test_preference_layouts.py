"""The preference step (train/preference_step.py) on every layout it runs on equals one process: DPO with three loss
types at once (sigmoid, ipo, sft: per-pair terms, per-length terms and a token mean) against a frozen copy of the
starting weights, at dp2 (with accumulation), FSDP, tp2 (with sequence parallelism and accumulation), cp2 (each
pair's log-probs summed over the ranks, with accumulation), ep2 on the MoE model, and LoRA against the adapters-off
reference at dp2 and tp2; SimPO and ORPO (no reference) at dp2 and pp2 (1F1B), ORPO at cp2; KTO (its KL estimate
over the global batch) at dp2 with accumulation, tp2 and cp2 with accumulation. Loss, gradient norm, TRL's rewards and
log-probs of every step and the validation loss within 1e-5 relative (fp32); DPO under bf16 autocast at dp2 and tp2
within BF16_RTOL of both the bf16 and the fp32 one-process runs; `reference: precomputed` (each rank reading its
own pairs' stored log-probs) at dp2 and tp2, and in one process equal to the frozen copy. Under pipeline
parallelism (the reference's stages walked forward-only before the policy's schedule, its log-probs kept on the
last stage): DPO against the frozen copy at pp2 under 1F1B and ZBV (whose last stage sits on the first rank), LoRA
against the adapters-off reference, `precomputed` (its one pass through the pipeline) and KTO (its KL rows through
the policy's stages), each at pp2 (1F1B). All cases in ONE 2-process launch (tests/dist/preference_worker.py)."""

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
    "dp2:dpo_bf16",
    "tp2:dpo_bf16",
    "dp2:dpo_pre",
    "tp2:dpo_pre",
    "dp2:orpo",
    "pp2_1f1b:orpo",
    "dp2_accum:kto",
    "tp2:kto",
    "cp2_accum:kto",
    # a reference under pipeline parallelism: its stages walked forward-only before the policy's schedule
    "pp2_1f1b:dpo",
    "pp2_zbv_zero_bubble:dpo",
    "pp2_1f1b:dpo_lora",
    "pp2_1f1b:dpo_pre",
    "pp2_1f1b:kto",
    "cp2:orpo",
]

# bf16 autocast (weights, gradients and optimizer states stay fp32) keeps 8 significant bits: a rounding is up to
# u = 2^-9 relative. A row's log-prob sums n completion tokens' fp32 log-softmax of bf16-rounded logits; roundings
# of either sign grow as sqrt(n) while the sum grows as n, so its relative error is about u / sqrt(n), under u / 3
# for the harness's completions: bound u / 2. The rewards, beta x (logp - reference logp), carry the policy's and the
# reference's errors: twice the log-probs' bound times beta x |logp|. The loss's pair terms follow the margins,
# differences of such sums that nearly cancel and do not average down as SFT's token mean does
# (tests/parity/test_parallel.py, 1e-3): 2.5 u. The gradient norm: SFT's bound, about 5 u. Accuracies are not
# compared: a pair whose margin is as small as the rounding (the first steps') may flip.
BF16_RTOL = {"loss": 5e-3, "grad_norm": 1e-2, "logps": 1e-3}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pref") / "r.json"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DIST / "preference_worker.py"), str(out), *SPECS]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=torchrun_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(Path(out).read_text())


def _differences(mine: list, ref: list, is_eval: bool, variant: str) -> list[str]:
    """Loss, gradient norm (auxiliary losses) and log-probs within 1e-5 relative; the rewards, beta x (logp - ref
    logp), a difference of two sums near -70 that nearly cancel, within 1e-5 of the log-probs they come from.
    bf16: BF16_RTOL's bounds, the accuracies left out."""
    n = 0 if is_eval else len(harness.PREFERENCE_METRICS)
    low = variant.endswith("_bf16")
    plain = [*mine[: len(mine) - n], *mine[len(mine) - 2 :]] if n else mine
    plain_ref = [*ref[: len(ref) - n], *ref[len(ref) - 2 :]] if n else ref
    tols = [FP32_RTOL] * len(plain)
    if low:
        tols = [BF16_RTOL["loss"], BF16_RTOL["grad_norm"], BF16_RTOL["logps"], BF16_RTOL["logps"]][: len(plain)]
    out = [f"{a} vs {b}" for a, b, tol in zip(plain, plain_ref, tols) if abs(a - b) > tol * abs(b)]
    if n:
        beta = float(harness.PREFERENCE_VARIANTS[variant]["preference_config.beta"])
        scale = beta * max(abs(ref[-1]), abs(ref[-2]))
        rewards = list(zip(mine[-n:-2], ref[-n:-2]))  # chosen, rejected, accuracies
        tol = 2 * BF16_RTOL["logps"] if low else FP32_RTOL
        out += [f"reward {a} vs {b}" for a, b in rewards[: 2 if low else 3] if abs(a - b) > tol * scale]
    return out


def test_every_layout_equals_one_process(results):
    variants = sorted({s.split(":")[1] for s in SPECS})
    reference = {v: harness.run_case(None, v, world_size=1)[0] for v in variants}
    bad = []
    for spec in SPECS:
        variant = spec.split(":")[1]
        # bf16 against the bf16 one process and the fp32 one (the same model and data)
        for want in [reference[variant]] + ([reference["dpo"]] if variant.endswith("_bf16") else []):
            got = results[spec]
            assert len(got) == len(want) == harness.STEPS + 1, spec
            for step, (mine, ref) in enumerate(zip(got, want), 1):
                assert len(mine) == len(ref), (spec, step)
                found = _differences(mine, ref, step > harness.STEPS, variant)
                bad += [f"{spec} step {step}: {m}" for m in found]
    assert not bad, "\n".join(bad)
    dpo = reference["dpo"]
    assert all(len(step) == 2 + len(harness.PREFERENCE_METRICS) for step in dpo[:-1])  # the metrics are there
    assert dpo[0][2] == 0.0 and dpo[-2][2] != 0.0  # rewards/chosen: zero at the start, then the policy moves
    # reference: precomputed (the log-probs of one pass before step 1) trains as the frozen copy does
    for step, (mine, ref) in enumerate(zip(reference["dpo_pre"], dpo), 1):
        assert len(mine) == len(ref) and not _differences(mine, ref, step > harness.STEPS, "dpo"), (step, mine, ref)
