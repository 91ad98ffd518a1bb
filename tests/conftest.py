"""Shared fixtures: a tokenizer and a packed dataset made once per session from the shipped Shakespeare text."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = sorted((ROOT / "data" / "shakespeare").glob("*.txt"))
DIST = ROOT / "tests" / "dist"  # what torchrun launches: the parity harness and its workers
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FP32_RTOL = 1e-5  # an fp32 parallel run against the single process: relative, per step


def torchrun_env() -> dict:
    """The environment a test's torchrun launch gets: one OpenMP thread per rank, no inherited WORLD_SIZE."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """Two plays, byte-level BPE with 512 tokens, packed; returns the dataset directory."""
    from meshformer.data.preprocess import preprocess
    from meshformer.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tinydata")
    files = [str(p) for p in CORPUS[:2]]
    train_tokenizer(files, 512, str(root / "tok"))
    preprocess(files, str(root / "tok"), str(root / "data"), val_fraction=0.05)
    return root / "data"


def tiny_overrides(dataset: Path, out: Path, extra: dict | None = None) -> list[str]:
    """Command-line style overrides for a ~60k-parameter model that trains in milliseconds per step."""
    base = {
        "model.model_config.hidden_size": 32,
        "model.model_config.num_layers": 2,
        "model.model_config.num_heads": 4,
        "model.model_config.n_kv_heads": 2,
        "model.model_config.intermediate_size": 64,
        "model.model_config.vocab_size": 512,
        "model.model_config.seq_length": 32,
        "train_dataset.data_loader.dataset_dir": str(dataset),
        "train_dataset.batch_size": 4,
        "output_dir": str(out),
        "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_steps": 3,
        "monitor_config.peak_flops": 1e12,
        "monitor_config.progress_bar": "plain",
        "callbacks": "[{type: MFLossMonitor, per_print_times: 100}, "
        "{type: CheckpointMonitor, save_checkpoint_steps: 1000}]",
    }
    base.update(extra or {})
    args = []
    for k, v in base.items():
        args += [f"--{k}", str(v)]
    return args


def checksums(root: Path) -> dict[str, str]:
    """Every file below root (but a run's lock, which only says who runs) -> its SHA-256."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }
