"""Memory: what a run measures by component (train/memory.py) and what the planner predicts (planner/), checked
against each other. The parallel layouts' measured bytes come from the parity suite's launches
(tests/parity/test_parallel.py::test_planner_predicts_every_layout)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, tiny_overrides
from meshformer.config import load_config
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.memory import plan_memory

STATES_RTOL, ACTIVATIONS_RTOL = 0.02, 0.10


def compare(measured: dict, predicted) -> list[str]:
    """Mismatches between a rank's measured breakdown (metrics field names) and its prediction."""
    bad = []
    for field, key, tol in (
        ("mem_params_bytes", "params_bytes", STATES_RTOL),
        ("mem_grads_bytes", "grads_bytes", STATES_RTOL),
        ("mem_optim_bytes", "optimizer_bytes", STATES_RTOL),
        ("mem_activations_bytes", "activations_bytes", ACTIVATIONS_RTOL),
    ):
        got, want = measured[field], getattr(predicted, key)
        if abs(want - got) > tol * max(got, 1):
            bad.append(f"{key}: predicted {want:,} measured {got:,} ({want / max(got, 1):.3f}x)")
    return bad


FEW_TOKENS_BF16 = {
    "model.model_config.compute_dtype": "bfloat16",
    "model.model_config.seq_length": 16,
    "train_dataset.batch_size": 1,
}
CASES = {
    "fp32": {},
    "full recompute": {"recompute_config.recompute": True},
    "selective recompute": {"recompute_config.select_recompute": True},
    "full and selective": {"recompute_config.recompute": [1], "recompute_config.select_recompute": True},
    "accumulation 4": {"runner_config.gradient_accumulation_steps": 4},
    "bf16 autocast": {"model.model_config.compute_dtype": "bfloat16"},
    # A recomputed layer's autocast weight copies are made again in its backward, not kept. Few tokens, so that
    # the copies weigh more than the activations' tolerance.
    "bf16, full recompute": {**FEW_TOKENS_BF16, "recompute_config.recompute": True},
    "bf16, selective recompute": {**FEW_TOKENS_BF16, "recompute_config.select_recompute": True},
    "selective, alternate matmuls": {
        "recompute_config.select_recompute": True,
        "recompute_config.select_recompute_policy": "alternate_matmuls",
    },
    "bf16, selective, alternate matmuls": {
        **FEW_TOKENS_BF16,
        "recompute_config.select_recompute": True,
        "recompute_config.select_recompute_policy": "alternate_matmuls",
    },
    "q/k norm, tied": {"model.model_config.use_qk_norm": True, "model.model_config.tie_word_embeddings": True},
    "lora": {"model.model_config.pet_method": "lora"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_run_reports_its_memory_and_the_planner_predicts_it(tiny_dataset, tmp_path, name):
    from meshformer.train.trainer import run_training

    extra = {"runner_config.stop_step": 2, "model.model_config.seq_length": 64, **CASES[name]}
    cfg = load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra))
    last = run_training(cfg)
    report = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert list(report) == ["0"] and report["0"]["stage"] == 0
    rank = report["0"]
    measured = {f"mem_{k.replace('optimizer', 'optim')}": v for k, v in rank.items() if k.endswith("_bytes")}
    for key in ("mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes", "mem_activations_bytes"):
        assert last[key] == measured[key] > 0
    # On the CPU the peak is the sum of the parts (no allocator peak to read).
    assert last["peak_mem_bytes"] == sum(last[k] for k in measured if k != "mem_peak_bytes")
    batch, accum = cfg.train_dataset.batch_size, cfg.runner_config.gradient_accumulation_steps
    predicted = plan_memory(cfg, ParallelDims.from_config(cfg, 1), batch, accum)
    assert compare(last, predicted[0]) == []


# ---- the seed's 7B figures through `meshformer plan` ------------------------------------------------------------

SEED = "configs/seed_pretrain_skeleton.yaml"  # section 3.3 as written: 7B Llama, dp2 x mp2 x pp2, 8 micro-batches
ONE_CARD = ["--parallel_config.data_parallel", "1", "--parallel_config.model_parallel", "1"]
ONE_CARD += ["--parallel_config.pipeline_stage", "1"]
BF16 = ["--model.model_config.compute_dtype", "bfloat16"]


def plan_json(capsys, *argv) -> dict:
    from meshformer.cli.main import main

    capsys.readouterr()
    assert main(["plan", str(ROOT / SEED), "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_seed_7b_states_are_16_bytes_a_parameter(capsys):
    from meshformer.models.llama import param_count

    plan = plan_json(capsys, "--devices", "1", *ONE_CARD, *BF16)
    n = param_count(load_config(str(ROOT / SEED)).model.model_config)
    stage = plan["stages"][0]
    states = stage["params_bytes"] + stage["grads_bytes"] + stage["optimizer_bytes"]
    # fp32 master weights (4) + fp32 gradients (4) + AdamW's two fp32 moments (8): the seed's 7B -> 112 GB
    assert abs(states / (16 * n) - 1) < 1e-3 and 105e9 < states < 113e9
    assert abs(stage["optimizer_bytes"] / (8 * n) - 1) < 1e-3  # the seed's 56 GB of moments
    assert not plan["fits"]


def test_seed_7b_layout_fits_8_cards_with_sharding_and_lora_fits_24_gb(capsys):
    as_written = plan_json(capsys)
    assert not as_written["fits"]  # fp32 compute (the skeleton sets no compute_dtype), nothing sharded
    sharded = plan_json(capsys, *BF16, "--parallel_config.optimizer_shard", "true")
    assert sharded["fits"] and len(sharded["stages"]) == 2
    assert sharded["layout"]["devices"] == 8 and sharded["device_memory_bytes"] == 80e9
    lora = ["--model.model_config.param_init_type", "bfloat16", "--model.model_config.pet_method", "lora"]
    lora += ["--train_dataset.batch_size", "1", "--recompute_config.recompute", "true"]
    one = plan_json(capsys, "--devices", "1", "--device-memory", "24", *ONE_CARD, *BF16, *lora)
    assert one["fits"] and one["stages"][0]["reserved_bytes"] < 24e9
    full = plan_json(capsys, "--devices", "1", "--device-memory", "24", *ONE_CARD, *BF16, *lora[:2], *lora[4:])
    assert not full["fits"]  # the same without LoRA does not


def test_plan_bad_input_is_one_line(capsys):
    from meshformer.cli.main import main

    for argv, needle in (
        (["--accelerator", "TPU9"], "--accelerator 'TPU9'"),
        (["--devices", "6"], "parallel_config"),
        (["--nodes", "3"], "--nodes 3"),
    ):
        capsys.readouterr()
        assert main(["plan", str(ROOT / SEED), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def test_select_recompute_forms_and_bad_ones(capsys):
    """MindSpore's dict form selects layers per stage; a key naming nothing recomputable, or a count list of the
    wrong length, is one line."""
    from meshformer.cli.main import main
    from meshformer.parallel.recompute import selective_plan

    assert selective_plan({"feed_forward\\.mul": [3, 1], "feed_forward\\.w1\\.activation\\.silu": [2, 2]}, 0, 4)[0] == 3
    assert selective_plan([1, 2], 1, 4)[0] == 2 and selective_plan(True, 0, 4)[0] == 4
    empty = str(ROOT / "tests" / "empty.yaml")
    for value, needle in (
        ("{'attention\\.flash': [1]}", "names no operation meshformer can recompute"),
        ("[1, 2]", "recompute_config.select_recompute=[1, 2]: give one non-negative layer count per pipeline stage"),
    ):
        capsys.readouterr()
        assert main(["config", "check", empty, "--recompute_config.select_recompute", value]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


@pytest.mark.parametrize(
    "rank, extra",
    [
        (0, ["--parallel_config.optimizer_shard", "true"]),  # dp2 x tp2 x pp2, ZeRO, stage 0 (embedding)
        (7, ["--parallel_config.optimizer_shard", "true"]),  # stage 1 (norm, head)
        (
            1,
            [
                "--parallel_config.data_parallel",
                "1",
                "--parallel_config.pipeline_stage",
                "1",
                "--parallel_config.model_parallel",
                "2",
            ],
        ),  # tp2 alone: the vocab-parallel embedding's whole gradient
    ],
)
def test_planner_states_equal_the_real_parallelize_path_on_fake_tensors_at_7b(rank, extra):
    """The seed's 7B cut by the real parallelize path (fake process group, FakeTensors: no memory), one forward and
    backward and one AdamW step: its parameter, gradient and optimizer bytes are the planner's, to the byte."""
    import subprocess
    import sys

    bf16 = ["--model.model_config.compute_dtype", "bfloat16"]
    cmd = [sys.executable, "-m", "meshformer.planner.fake_check", str(ROOT / SEED), "--rank", str(rank), *bf16, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    fake = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = load_config(str(ROOT / SEED), [*bf16, *extra])
    pc = cfg.parallel_config
    world = pc.data_parallel * pc.model_parallel * pc.pipeline_stage
    dims = ParallelDims.from_config(cfg, world)
    stage = plan_memory(cfg, dims, 4, 8 if pc.pipeline_stage > 1 else 1)[dims.coords(rank)["pp"]]
    assert fake["stage"] == stage.stage
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert fake[key] == getattr(stage, key), (key, fake[key], getattr(stage, key))


# ---- the planner against the CUDA allocator's peaks measured on one H200 (docs/memory.md) ------------------------

# (preset, layers (0: all), seq, micro batch, bench/gpu_train.py mode, measured peak allocated GiB)
H200_PEAKS = [
    ("1b", 0, 2048, 4, "none", 43.84),
    ("1b", 0, 2048, 4, "selective", 33.53),
    ("1b", 0, 2048, 4, "full", 27.26),
    ("8b", 8, 8192, 2, "selective", 69.92),
    ("8b", 0, 2048, 1, "full", 119.76),
]


@pytest.mark.parametrize("preset,layers,seq,batch,mode,measured", H200_PEAKS)
def test_planner_predicts_the_h200_peaks_within_5_percent(preset, layers, seq, batch, mode, measured):
    """bf16 autocast over fp32 weights, one device: under recompute the forward's end holds autocast's cached
    weight copies beside the logits, though no recomputed layer saves them for backward."""
    import sys

    from meshformer.planner.accelerators import ACCELERATORS
    from meshformer.planner.plan import make_plan

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_train import MODES, PRESETS

    model = {**PRESETS[preset], "seq_length": seq, "compute_dtype": "bfloat16"}
    if layers:
        model["num_layers"] = layers
    flat = [x for k, v in model.items() for x in (f"--model.model_config.{k}", str(v))]
    cfg = load_config(None, [*flat, "--train_dataset.batch_size", str(batch), *MODES[mode]])
    stage = make_plan(cfg, ParallelDims.from_config(cfg, 1), ACCELERATORS["H200"], batch, 1).stages[0]
    assert abs(stage.allocated_bytes / 2**30 / measured - 1) < 0.05
