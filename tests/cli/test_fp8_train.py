"""FP8 linears on a CPU: 20 steps of the demo-sized model (configs/demo_shakespeare.yaml's shape) train with FP8
losses close to bf16's, within a bound derived from bf16's own distance to fp32.

The bound: FP8 and bf16 round the same matmul operands (autocast's bf16 casts; torchao's float8 casts of input,
weight and gradient), only coarser. A rounding error's effect on the loss grows in proportion to the format's unit
roundoff while it is small, so FP8's distance from bf16 is about (FP8 roundoff / bf16 roundoff) x bf16's distance
from fp32. bf16 keeps 8 significant bits (roundoff 2^-8); tensorwise FP8 keeps 4 in the forward (e4m3, 2^-4) and
3 for gradients (e5m2, 2^-3): a ratio of at most 2^5 = 32, the bound's factor.
"""

from __future__ import annotations

import json

from conftest import tiny_overrides
from meshformer.config import load_config
from meshformer.train.trainer import run_training

STEPS = 20
M = "model.model_config."
DEMO = {
    M + "hidden_size": 256, M + "num_layers": 4, M + "num_heads": 8, M + "n_kv_heads": 4,
    M + "intermediate_size": 688, M + "vocab_size": 2048, M + "seq_length": 128, M + "tie_word_embeddings": True,
    "train_dataset.batch_size": 4, "optimizer.learning_rate": 2e-3, "runner_config.stop_step": STEPS, "seed": 1234,
}  # fmt: skip
ROUNDOFF_RATIO = 2.0**-3 / 2.0**-8


def _losses(dataset, out, extra: dict) -> list[float]:
    cfg = load_config(None, tiny_overrides(dataset, out, {**DEMO, **extra}))
    run_training(cfg)
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_twenty_fp8_steps_track_bf16_within_the_derived_bound(tiny_dataset, tmp_path, capsys):
    fp32 = _losses(tiny_dataset, tmp_path / "fp32", {})
    bf16 = _losses(tiny_dataset, tmp_path / "bf16", {M + "compute_dtype": "bfloat16"})
    capsys.readouterr()
    fp8 = _losses(tiny_dataset, tmp_path / "fp8", {M + "compute_dtype": "bfloat16", "fp8_config.enable": True})
    log = capsys.readouterr()
    assert "fp8: 28 decoder linears in FP8 (tensorwise)" in log.out + log.err  # every linear (all are x16)
    assert len(fp8) == len(bf16) == STEPS
    bf16_gap = max(abs(b - f) for b, f in zip(bf16, fp32))
    fp8_gap = max(abs(q - b) for q, b in zip(fp8, bf16))
    assert 0 < fp8_gap <= ROUNDOFF_RATIO * bf16_gap, (fp8_gap, bf16_gap, fp8, bf16)
    assert sum(fp8[-3:]) / 3 < sum(fp8[:3]) / 3 - 0.5, fp8  # and it trains
