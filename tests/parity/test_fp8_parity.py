"""FP8 linears (fp8_config) under FSDP2 and tensor parallelism give the one-process FP8 numbers.

One launch of two processes runs fsdp2 and tp2 (tensorwise: torchao's FP8 TP styles; and rowwise_with_gw_hp under
fsdp2) over fp32 activations, and fsdp2 and tp2 as a user runs FP8 (bf16 compute). The reference of a layout is
one process that sees the same tensors: under tp2 the whole batch, as one process does; under fsdp2 each rank's
rows as one micro-batch, because dynamic scaling takes an activation's scale from the rows a rank holds (as in
torchtitan: no layout all-reduces activation scales), so one process of the same micro-batches scales alike.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import DIST, FP32_RTOL, ROOT, TORCHRUN, rel, torchrun_env

sys.path.insert(0, str(DIST))
import harness  # noqa: E402

SPECS = ["fsdp2:fp8_fp32", "tp2:fp8_fp32", "fsdp2:fp8_gw_fp32", "fsdp2:fp8", "tp2:fp8"]
# The first step (forward and backward of the same weights) meets fp32's 1e-5. Later steps drift further: a value
# that the layout's fp32 reduction order moves by 1e-7 across an FP8 rounding boundary changes by a whole FP8 step
# (2^-4 relative for e4m3, 2^-3 for e5m2 gradients), and AdamW's early updates (about lr x sign of the gradient)
# carry such a flip into every later step, so the gap grows about tenfold a step (measured over 5 steps: 3e-7,
# 6e-5, 7e-4 in the loss). Held after the first step: 5e-3 in the loss (an FP8 relative rounding, 2^-4, times the
# few percent of its effect that survives averaging over ~230 tokens) and 5e-2 in the grad norm.
LATER_RTOL = {"loss": 5e-3, "grad_norm": 5e-2}
# One exception on the first step: under tp2 the tensorwise recipe casts each output gradient to e5m2 (3 significant
# bits) after tensor parallelism's all-reduce of partial sums, whose order differs from one process's matmul by
# ~1e-7; the few elements that this moves across an e5m2 boundary change by 2^-3 each. Measured: 2.3e-5 in the
# first step's grad norm (its loss within 2e-7). Held to 1e-4.
TP_FIRST_GRAD_NORM_RTOL = 1e-4


def _reference(variant: str, n_micro: int) -> list:
    from meshformer.parallel import init_parallel

    cfg = harness.variant_cfg(variant)
    return harness.run(cfg, init_parallel(cfg, 1), n_micro)[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fp8") / "out.json"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(DIST / "parity_worker.py"), str(out), *SPECS]
    p = subprocess.run(
        ["flock", "/tmp/meshformer-heavy.lock", *cmd],
        capture_output=True, text=True, timeout=900, env=torchrun_env(), cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(out.read_text())


def test_fsdp2_and_tp2_equal_one_process_in_fp8(results):
    bad = []
    for spec in SPECS:
        case, variant = spec.split(":")
        ref = _reference(variant, harness.spec_of(case)[1] * (2 if case.startswith("fsdp2") else 1))
        got = results[spec]
        assert len(got) == harness.STEPS + 1, spec
        for step, ((loss, gn), (rloss, rgn)) in enumerate(zip(got[:-1], ref[:-1]), 1):
            first = step == 1 and variant.endswith("_fp32")
            tol_l, tol_g = (FP32_RTOL, FP32_RTOL) if first else (LATER_RTOL["loss"], LATER_RTOL["grad_norm"])
            if first and case.startswith("tp2") and variant == "fp8_fp32":
                tol_g = TP_FIRST_GRAD_NORM_RTOL
            if rel(loss, rloss) > tol_l or rel(gn, rgn) > tol_g:
                bad.append(f"{spec} step {step}: loss {loss} vs {rloss}, grad norm {gn} vs {rgn}")
        if rel(got[-1][0], ref[-1][0]) > LATER_RTOL["loss"]:
            bad.append(f"{spec} eval loss {got[-1][0]} vs {ref[-1][0]}")
    assert not bad, "\n".join(bad)
