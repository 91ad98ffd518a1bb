"""Streaming `meshformer preprocess` at scale: peak memory of the whole process tree on two corpus sizes, throughput
against the `tokenizers` library's own `encode_batch` on the same text and cores, and the scaling with --workers.

The corpus is the shipped Shakespeare (data/shakespeare/*.txt) remixed: each document is a seeded draw of 20-60 of
its lines, so documents differ and deduplication keeps them, written as paragraphs of one .txt file
(--text-split paragraph). The tokenizer is a byte-level BPE of --vocab ids trained on the same plays with
`meshformer tokenizer train`. Prints one JSON object per measurement; not a test.

    .venv/bin/python bench/preprocess.py --sizes-gb 0.5 2 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PLAYS = sorted((ROOT / "data" / "shakespeare").glob("*.txt"))


def make_corpus(path: Path, size: int, seed: int = 0) -> int:
    """Paragraph documents of 20-60 seeded lines until `size` bytes; returns the document count."""
    lines = [line for p in PLAYS for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    rng, written, docs = random.Random(seed), 0, 0
    with path.open("w", encoding="utf-8") as fh:
        while written < size:
            block = []
            for _ in range(256):
                block.append("\n".join(rng.choices(lines, k=rng.randint(20, 60))) + "\n\n")
            text = "".join(block)
            fh.write(text)
            written += len(text.encode("utf-8"))
            docs += len(block)
    return docs


def run_tree(argv: list[str]) -> dict:
    """Run argv; wall time and the peak of the summed RSS of it and its children (sampled every 0.1 s)."""
    t0 = time.perf_counter()
    proc = psutil.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [proc, *proc.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    if proc.returncode:
        raise SystemExit(f"{argv} failed: {proc.stderr.read().decode()[-2000:]}")
    return {"seconds": round(time.perf_counter() - t0, 2), "peak_rss_tree_mb": round(peak / 2**20, 1)}


def preprocess_run(corpus: Path, tok: Path, out: Path, workers: int) -> dict:
    argv = [sys.executable, "-m", "meshformer", "preprocess", "--input", str(corpus), "--tokenizer", str(tok)]
    argv += ["--output", str(out), "--text-split", "paragraph", "--workers", str(workers), "--overwrite"]
    r = run_tree(argv)
    meta = json.loads((out / "meta.json").read_text())
    r["tokens"] = meta["splits"]["train"]["tokens"] + meta["splits"]["validation"]["tokens"]
    r["documents"] = meta["documents_read"]
    r["duplicates_removed"] = meta["duplicates_removed"]
    return r


def reference_encode_batch(corpus: Path, tok_dir: Path, batch_docs: int = 512) -> dict:
    """tokenizers' own Tokenizer.encode_batch (its Rust thread pool, every core) over the same documents; only the
    encode calls are timed (reading the file is not)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    encode_s, tokens, batch = 0.0, 0, []

    def flush():
        nonlocal encode_s, tokens
        t = time.perf_counter()
        tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
        encode_s += time.perf_counter() - t
        batch.clear()

    with corpus.open(encoding="utf-8") as fh:
        para: list[str] = []
        for line in fh:
            if line.strip():
                para.append(line)
                continue
            if para:
                batch.append("".join(para).strip())
                para = []
                if len(batch) >= batch_docs:
                    flush()
        if para:
            batch.append("".join(para).strip())
    if batch:
        flush()
    return {"seconds": round(encode_s, 2), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[0.5, 2.0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts, on the smallest size")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench_preprocess_"))
    scratch.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(json.dumps({"cpu": cpu, "cores": os.cpu_count(), "scratch": str(scratch)}), flush=True)
    tok = scratch / "tok"
    if not (tok / "tokenizer.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "meshformer", "tokenizer", "train", "--input", *map(str, PLAYS), "--vocab-size",
             str(args.vocab), "--output", str(tok)], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    sizes = sorted(args.sizes_gb)
    corpora = {}
    for gb in sizes:
        corpus = scratch / f"corpus_{gb}gb.txt"
        t = time.perf_counter()
        docs = make_corpus(corpus, int(gb * 2**30))
        corpora[gb] = corpus
        made = {"corpus_gb": gb, "bytes": corpus.stat().st_size, "documents": docs, "seconds": time.perf_counter() - t}
        print(json.dumps({"made": made}), flush=True)
    small = corpora[sizes[0]]
    ref = reference_encode_batch(small, tok)
    ref_mb_s = small.stat().st_size / 2**20 / ref["seconds"]
    print(json.dumps({"reference_encode_batch": {**ref, "corpus_gb": sizes[0], "mb_per_s": round(ref_mb_s, 2)}}))
    for w in sorted(args.workers):
        r = preprocess_run(small, tok, scratch / f"out_{sizes[0]}_{w}", w)
        mb_s = small.stat().st_size / 2**20 / r["seconds"]
        r.update(corpus_gb=sizes[0], workers=w, mb_per_s=round(mb_s, 2), vs_encode_batch=round(mb_s / ref_mb_s, 3))
        print(json.dumps({"preprocess": r}), flush=True)
    w = max(args.workers)
    for gb in sizes[1:]:
        r = preprocess_run(corpora[gb], tok, scratch / f"out_{gb}_{w}", w)
        r.update(corpus_gb=gb, workers=w, mb_per_s=round(corpora[gb].stat().st_size / 2**20 / r["seconds"], 2))
        print(json.dumps({"preprocess": r}), flush=True)


if __name__ == "__main__":
    main()
