"""Hostile and out-of-range config input: one line on stderr, exit code 2, fast, and no file changed.

Alias bombs and oversized files are refused at load (config/load.py), values torch would crash on at
validation (schema ranges, config/validate.py), sizes that cannot fit before anything is allocated
(planner/fits.py); the learning-rate warnings state what `lr_at` does; eval's numeric flags are checked.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from conftest import EMPTY, checksums, fails, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.train.optim import lr_at, schedule_warnings, warmup_steps
from test_bad_input import train_argv


def bomb(levels: int, indent: str = "    ") -> str:
    """Nested anchors: level i is ten aliases of level i - 1, so the last one expands to 10**levels strings."""
    lines = [f"{indent}a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{indent}a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def refused_fast(capsys, tmp_path: Path, argv: list[str], *needles: str) -> str:
    before = checksums(tmp_path)
    t0 = time.perf_counter()
    err = fails(capsys, argv, *needles)
    assert time.perf_counter() - t0 < 10.0, "must be refused at load, before any expansion"
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()
    return err


# ---------------------------------------------------------------- YAML alias bombs and oversized files


@pytest.mark.parametrize(
    "body",
    [
        "parallel:\n  parallel_optimizer_config:\n" + bomb(9),  # a free-form dict field
        "runner_wrapper:\n  scale_sense:\n" + bomb(9),
        "callbacks:\n  - type: MFLossMonitor\n    laughs:\n" + bomb(9, "      "),  # inside a list item
    ],
)
def test_a_nine_level_alias_bomb_is_refused_at_load(tiny_dataset, tmp_path, capsys, body):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(body)
    argv = ["train", str(cfg), *tiny_overrides(tiny_dataset, tmp_path / "out")]
    refused_fast(capsys, tmp_path, argv, "bomb.yaml", "expands to more than 100,000 values", "a config is not data")


def test_an_alias_bomb_on_the_command_line_is_refused(tmp_path, capsys):
    levels = [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    value = "{a0: &a0 [x, x, x, x, x, x, x, x, x, x], " + ", ".join(levels) + "}"
    argv = ["train", EMPTY, "--output_dir", str(tmp_path / "out"), "--parallel.parallel_optimizer_config", value]
    refused_fast(capsys, tmp_path, argv, "override --parallel.parallel_optimizer_config", "expands to more than")


@pytest.mark.parametrize(
    "body, needle",
    [
        ("parallel:\n  parallel_optimizer_config: &me {again: *me}\n", "contains an alias to itself"),
        (
            "parallel:\n  parallel_optimizer_config: " + "[" * 500_000 + "]" * 500_000 + "\n",
            "nests more than 64 levels",
        ),
        ("".join(" " * i + "a:\n" for i in range(200)), "nests more than 64 levels deep (line 64)"),
    ],
)
def test_self_referencing_and_deeply_nested_yaml(tmp_path, capsys, body, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(body)
    refused_fast(capsys, tmp_path, ["train", str(cfg), "--output_dir", str(tmp_path / "out")], needle)


def test_a_config_over_one_mib_is_refused_before_it_is_read(tmp_path, capsys):
    cfg = tmp_path / "big.yaml"
    cfg.write_text("seed: 1\n" + "# padding\n" * 110_000)  # valid YAML, 1.05 MiB
    refused_fast(capsys, tmp_path, ["train", str(cfg)], "is 1.0 MiB, over the 1 MiB limit", "a config is not data")


def test_ordinary_anchors_and_merge_keys_still_load(tmp_path):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(
        "parallel:\n  parallel_optimizer_config: &base {gradient_accumulation_shard: false, shard: 4}\n"
        "runner_wrapper:\n  scale_sense: {<<: *base, shard: 8}\n"
        "callbacks:\n  - &log {type: MFLossMonitor, per_print_times: 7}\n  - *log\n"
    )
    c = load_config(cfg)
    assert c.runner_wrapper.scale_sense == {"gradient_accumulation_shard": False, "shard": 8}
    assert [cb.per_print_times for cb in c.callbacks] == [7, 7]


# ---------------------------------------------------------------- values validation must refuse before torch sees them


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"optimizer.beta1": 1.0}, "optimizer.beta1=1.0 is out of range: it must be < 1"),
        ({"optimizer.beta2": 1}, "optimizer.beta2=1.0 is out of range: it must be < 1"),
        ({"optimizer.betas": "[0.9, 1.0]"}, "optimizer.betas=[0.9, 1.0]: give two numbers in [0, 1)"),
        ({"optimizer.betas": "[0.9, true]"}, "optimizer.betas=[0.9, True]: give two numbers in [0, 1)"),
        ({"optimizer.learning_rate": 0}, "optimizer.learning_rate=0.0 is out of range: it must be > 0"),
        ({"lr_schedule.learning_rate": 0}, "lr_schedule.learning_rate=0.0 is out of range: it must be > 0"),
        ({"seed": 2**63}, f"seed={2**63} is out of range: it must be <= {2**32 - 1}"),
        ({"model.model_config.ignore_token_id": 2**63}, f"ignore_token_id={2**63} is out of range"),
        ({"lr_schedule.lr_end": 1e30}, "lr_schedule.lr_end=1e+30 is above the peak learning rate 0.003"),
        (  # the adapters were allocated before any check: 128 GB at once
            {"model.model_config.pet_config.pet_type": "lora", "model.model_config.pet_config.lora_rank": 10**9},
            "lora_rank=1000000000 is wider than any linear of the model (at most 64)",
        ),
        (  # Llama's FFN rule: int(1e308 x 85) is int(inf)
            {"model.model_config.ffn_dim_multiplier": 1e308, "model.model_config.intermediate_size": "null"},
            "ffn_dim_multiplier=1e+308 is out of range: it must be <= 100",
        ),
    ],
)
def test_values_torch_refuses_are_refused_at_validation(tiny_dataset, tmp_path, capsys, extra, needle):
    refused_fast(capsys, tmp_path, train_argv(tiny_dataset, tmp_path / "out", extra), needle)


def test_the_ranges_match_what_torch_accepts():
    """The bounds of the schema are torch's: just inside them AdamW builds and steps; the bound itself raises."""
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    torch.optim.AdamW([p], lr=1e-300, betas=(0.0, 0.999999), eps=1e-300, weight_decay=0.0).step()
    for bad in ({"betas": (1.0, 0.9)}, {"betas": (0.9, 1.0)}, {"eps": -1e-8}, {"weight_decay": -0.1}, {"lr": -1e-3}):
        with pytest.raises(ValueError):
            torch.optim.AdamW([p], **{"lr": 1e-3, **bad})
    for field, value in (("beta1", 0.0), ("beta2", 0.999999), ("eps", 1e-300), ("learning_rate", 1e-300)):
        load_config(None, [f"--optimizer.{field}", str(value)])  # accepted
    torch.manual_seed(2**32 - 1)
    load_config(None, ["--seed", str(2**32 - 1)])


# ---------------------------------------------------------------- sizes that cannot fit, refused before allocating


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"model.model_config.vocab_size": 10**12}, "parameters"),
        ({"model.model_config.hidden_size": 10**9}, "parameters"),
        ({"model.model_config.num_layers": 2**63}, "parameters"),
        ({"model.model_config.seq_length": 10**9}, "check seq_length and train_dataset.batch_size for a typo"),
        ({"train_dataset.batch_size": 10**9}, "micro batch 1000000000"),  # the memory floor speaks before the data
        ({"train_dataset.batch_size": 10**5}, "fewer than one global batch (global batch 100000"),  # fits: the data
    ],
)
def test_huge_sizes_fail_in_one_line_before_allocating(tiny_dataset, tmp_path, capsys, extra, needle):
    refused_fast(capsys, tmp_path, train_argv(tiny_dataset, tmp_path / "out", extra), needle)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model.model_config.seq_length", "1000000000"], "seq_length=1000000000 x micro batch 1"),
        (["--runner_config.batch_size", "1000000000"], "x micro batch 1000000000"),
        (["--model.model_config.seq_length", str(2**62), "--train_dataset.batch_size", str(2**62)], "GiB per rank"),
        (["--model.model_config.vocab_size", str(2**62)], "parameters"),
    ],
)
def test_the_memory_floor_covers_activations_and_any_integer(args, needle):
    """check_fits on its own: a dataset big enough for a 10**9-token sample does not save the run from it."""
    from meshformer.errors import UserError
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.fits import check_fits

    cfg = load_config(None, ["--model.model_config.hidden_size", "256", "--model.model_config.num_layers", "2", *args])
    with pytest.raises(UserError, match="for a typo") as e:
        check_fits(cfg, ParallelDims.from_config(cfg, 1), torch.device("cpu"))
    assert needle in str(e.value)
    small = load_config(None, ["--model.model_config.hidden_size", "256", "--model.model_config.num_layers", "2"])
    check_fits(small, ParallelDims.from_config(small, 1), torch.device("cpu"))  # the default 2048 x 1 fits


# ---------------------------------------------------------------- learning-rate warnings state what lr_at does


def _lrs(cfg, run: int) -> tuple[list[float], float]:
    ls = cfg.lr_schedule
    total = ls.total_steps if ls.total_steps > 0 else run
    kw = dict(peak=cfg.optimizer.learning_rate, end=ls.lr_end, warmup=warmup_steps(cfg, total), total=total)
    return [lr_at(s, **kw, kind=ls.type) for s in range(run)], kw["peak"]


@pytest.mark.parametrize(
    "args, run, expect",
    [
        (["--optimizer.warmup_steps", "10"], 4, ["optimizer.warmup_steps=10: the warm-up (10 steps) is longer than"]),
        (["--lr_schedule.warmup_ratio", "1.0"], 6, ["warmup_ratio=1: the warm-up (6 steps) is as long as the run"]),
        (["--optimizer.warmup_steps", "3", "--lr_schedule.total_steps", "2"], 4, ["peak 0.001 at step 3, and stays"]),
        (["--lr_schedule.warmup_steps", "3", "--lr_schedule.total_steps", "3"], 8, ["drops to lr_end=0 at step 5"]),
        (["--lr_schedule.total_steps", "5", "--lr_schedule.lr_end", "1e-5"], 10, ["by step 6", "remaining 5 steps"]),
        (["--lr_schedule.total_steps", "5", "--lr_schedule.type", "constant"], 10, []),
        (["--optimizer.warmup_steps", "2"], 10, []),
    ],
)
def test_schedule_warnings_are_true(args, run, expect):
    cfg = load_config(None, ["--optimizer.learning_rate", "1e-3", *args])
    warnings = schedule_warnings(cfg, run)
    assert len(warnings) == (1 if expect else 0) and all(e in warnings[0] for e in expect), warnings
    lrs, peak = _lrs(cfg, run)
    text = " ".join(warnings)
    if "rises for the whole run" in text:  # increasing to the last step, and the figure printed is that step's
        assert all(a < b for a, b in zip(lrs, lrs[1:])) and f"to {lrs[-1]:g} at its last step" in text
    if "stays there to the end" in text:
        assert lrs[2:] == [peak] * (run - 2) and lrs[1] < peak
    if "drops to lr_end" in text:  # 1-based step 5: the first at lr_end, right after two steps at the peak
        assert lrs[2:4] == [peak, peak] and lrs[4:] == [0.0] * (run - 4)
    if "by step 6" in text:
        assert lrs[5:] == [1e-5] * 5 and lrs[4] > 1e-5
    if not warnings:  # nothing to warn about: the run reaches its peak and ends where the schedule ends
        assert max(lrs) == peak


def test_the_trainer_prints_the_warm_up_warning(tiny_dataset, tmp_path, capsys):
    assert main(train_argv(tiny_dataset, tmp_path / "o", {"runner_config.stop_step": 2})) == 0  # warm-up 3 steps
    out = capsys.readouterr().out
    assert "warning: optimizer.warmup_steps=3: the warm-up (3 steps) is longer than the run (2 steps)" in out
    assert "to 0.002 at its last step (67% of the peak 0.003), and never decays" in out


# ---------------------------------------------------------------- eval's numeric flags


@pytest.fixture(scope="module")
def checkpoint(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(train_argv(tiny_dataset, out, {"runner_config.stop_step": 1})) == 0
    return out


@pytest.mark.parametrize("flag", ["0", "-3"])
def test_eval_refuses_a_window_below_one_token(checkpoint, tmp_path, capsys, flag):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 4)
    argv = ["eval", "--checkpoint", str(checkpoint), "--input", str(text)]
    before = checksums(checkpoint.parent)
    fails(capsys, [*argv, f"--seq-length={flag}"], f"--seq-length {flag}", "at least 1 token")
    assert main([*argv, "--seq-length", "8", "--json"]) == 0 and '"tokens"' in capsys.readouterr().out
    assert checksums(checkpoint.parent) == before


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--temperature", "nan"], "--temperature nan: must be a number >= 0"),
        (["--seed", str(2**64)], "must be in [0, 2**64)"),
    ],
)
def test_generate_refuses_what_torch_would_crash_on(checkpoint, capsys, flags, needle):
    fails(capsys, ["generate", "--checkpoint", str(checkpoint), "--prompt", "To be", *flags], needle)
