"""The planner's memory for a DPO run against the memory meter (train/memory.py) on CPU: the policy's states and
the activations of its doubled rows (a pair is two rows), the frozen reference's weights (`copy`: the policy's
again; `adapter`: none), its no_grad forward's peak, and `precomputed`: nothing on the device. The tolerances are
the SFT comparison's (tests/cli/test_memory.py)."""

from __future__ import annotations

import json

import pytest

from conftest import LORA, preference_run_dir, tiny_overrides
from meshformer.config import load_config
from meshformer.parallel.dims import ParallelDims
from meshformer.planner.accelerators import cpu_accelerator
from meshformer.planner.plan import make_plan
from test_memory import ACTIVATIONS_RTOL, STATES_RTOL, compare
from test_preference_train import RECORDS, train


@pytest.fixture(scope="module")
def pairs(tiny_dataset, tmp_path_factory):
    """The tiny Llama (`hf`) and its preference pairs (`data`), as tests/cli/test_preference_train.py trains them."""
    return preference_run_dir(tmp_path_factory.mktemp("dpo_mem"), tiny_dataset.parent / "tok", RECORDS, 0.25)


def run(root, out, extra: dict):
    """Two DPO steps of the tiny Llama; (the last metrics record, the planner's stage for the same config)."""
    last = train(root, out, {"runner_config.stop_step": 2, **extra})[-1]
    cfg = load_config(None, tiny_overrides(root / "data", out, {"preference_config.method": "dpo", **extra}))
    cfg.train_dataset.batch_size = 2  # pairs, as train() runs
    batch, accum = cfg.train_dataset.batch_size, cfg.runner_config.gradient_accumulation_steps
    return last, make_plan(cfg, ParallelDims.from_config(cfg, 1), cpu_accelerator(), batch, accum).stages[0]


CASES = {
    "copy": {"preference_config.reference": "copy"},
    "copy, bf16 autocast": {"preference_config.reference": "copy", "model.model_config.compute_dtype": "bfloat16"},
    "copy, accumulation 2": {"preference_config.reference": "copy", "runner_config.gradient_accumulation_steps": 2},
    "adapter": {**LORA, "preference_config.reference": "adapter"},
    "adapter, bf16 autocast": {
        **LORA,
        "preference_config.reference": "adapter",
        "model.model_config.compute_dtype": "bfloat16",
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_planner_predicts_what_the_meter_measures_for_a_dpo_run(pairs, tmp_path, name):
    last, stage = run(pairs, tmp_path / "run", CASES[name])
    assert compare(last, stage.memory) == []  # the policy: its states and its doubled rows' activations
    second = stage.second
    assert second.kind == f"reference: {CASES[name]['preference_config.reference']}"
    weights = last["mem_reference_bytes"]
    assert abs(second.weights_bytes - weights) <= STATES_RTOL * max(weights, 1)
    assert (weights == 0) == (second.kind == "reference: adapter")  # adapters off: no second copy
    forward = last["mem_reference_forward_bytes"]
    assert forward > 0 and abs(second.forward_bytes - forward) <= ACTIVATIONS_RTOL * forward, (forward, second)
    # on the CPU the meter's peak is the states, the reference's weights and the larger of the two forwards
    states = last["mem_params_bytes"] + last["mem_grads_bytes"] + last["mem_optim_bytes"]
    assert last["peak_mem_bytes"] == states + weights + max(last["mem_activations_bytes"], forward)


def test_precomputed_reference_keeps_nothing_on_the_device(pairs, tmp_path):
    last, stage = run(pairs, tmp_path / "run", {"preference_config.reference": "precomputed"})
    assert compare(last, stage.memory) == []
    assert stage.second.kind == "reference: precomputed"
    assert stage.second.weights_bytes == stage.second.forward_bytes == 0
    assert last.get("mem_reference_bytes", 0) == 0 and last.get("mem_reference_forward_bytes", 0) == 0
    splits = json.loads((pairs / "data" / "meta.json").read_text())["splits"]
    n = sum(split["samples"] for split in splits.values())
    assert stage.second.disk_bytes == 16 * n  # a float64 log-probability per sequence, two a pair, every split
    stored = tmp_path / "run" / "reference_logps.safetensors"  # what the run wrote: the tables and a small header
    assert stage.second.disk_bytes <= stored.stat().st_size <= stage.second.disk_bytes + 4096
