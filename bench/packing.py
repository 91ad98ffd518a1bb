#!/usr/bin/env python
"""Packed versus padded instruction data: rows, padding and the time of one epoch over the same samples.

Makes the Shakespeare instruction set (scripts/shakespeare_sft.py), a byte-level BPE tokenizer trained on the
plays (4,096 tokens; chatml template), preprocesses it once, then trains a small Llama for one epoch twice in
fresh processes: one sample per row (padding) and several per row (`train_dataset.data_loader.packing: true`,
document masking). Both see every training sample exactly once, with the same micro-batch of rows; the packed run
needs fewer rows, so fewer steps. Validation loss is measured on padded rows in both, so the figures compare.

    python bench/packing.py [--work runs/bench_packing] [--seq-length 512] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_memory import ROOT, cpu, meshformer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_packing"))
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    work = Path(args.work)
    tok, data, jsonl = work / "tok", work / "data", work / "sft.jsonl"
    if not data.exists():
        work.mkdir(parents=True, exist_ok=True)
        plays = [str(p) for p in sorted((ROOT / "data" / "shakespeare").glob("*.txt"))]
        meshformer("tokenizer", "train", "--input", *plays, "--vocab-size", "4096", "--output", str(tok))
        subprocess.run([sys.executable, str(ROOT / "scripts/shakespeare_sft.py"), "--output", str(jsonl)], check=True)
        meshformer(
            "preprocess",
            "--input",
            str(jsonl),
            "--tokenizer",
            str(tok),
            "--output",
            str(data),
            "--seq-length",
            str(args.seq_length),
            "--val-fraction",
            "0.05",
        )
    model = {
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 8,
        "n_kv_heads": 4,
        "intermediate_size": 704,
        "vocab_size": 4096,
        "seq_length": args.seq_length,
    }
    print(f"CPU: {cpu()}; seq_length {args.seq_length}, micro batch {args.batch} rows, one epoch")
    for packing in (False, True):
        out = work / f"run_packing_{packing}".lower()
        shutil.rmtree(out, ignore_errors=True)
        over = {
            **{f"model.model_config.{k}": v for k, v in model.items()},
            "train_dataset.data_loader.dataset_dir": data,
            "train_dataset.batch_size": args.batch,
            "train_dataset.data_loader.packing": packing,
            "runner_config.epochs": 1,
            "do_eval": True,
            "eval_config.eval_iters": 1000,
            "optimizer.learning_rate": 1e-3,
            "optimizer.warmup_steps": 5,
            "output_dir": out,
            "monitor_config.progress_bar": "plain",
            "callbacks": "[{type: MFLossMonitor, per_print_times: 1000}, {type: CheckpointMonitor, "
            "save_checkpoint_steps: 100000}]",
        }
        argv = [x for k, v in over.items() for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "meshformer", "train", str(ROOT / "tests" / "empty.yaml"), *argv],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        if p.returncode:
            sys.exit(p.stdout[-2000:] + p.stderr[-2000:])
        recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        note = next(
            (ln.split("data: ", 1)[1].strip() for ln in p.stdout.splitlines() if "instruction data: " in ln), ""
        )
        train_s = sum(r["step_time_s"] for r in recs)
        print(
            f"packing={str(packing).lower():<5} steps {len(recs):>4}  train time {train_s:7.1f} s "
            f"(process {wall:6.1f} s)  final loss {recs[-1]['loss']:.4f}  validation loss "
            f"{recs[-1]['eval_loss']:.4f}  {note}"
        )


if __name__ == "__main__":
    main()
