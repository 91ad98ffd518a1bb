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
from meshformer.planner.memory import plan_memory
from meshformer.planner.plan import make_plan
from meshformer.planner.second_model import reference_forward_bytes
from test_memory import ACTIVATIONS_RTOL, STATES_RTOL, compare
from test_preference_train import KTO_RECORDS, RECORDS, train


@pytest.fixture(scope="module")
def pairs(tiny_dataset, tmp_path_factory):
    """The tiny Llama (`hf`) and its preference pairs (`data`), as tests/cli/test_preference_train.py trains them."""
    return preference_run_dir(tmp_path_factory.mktemp("dpo_mem"), tiny_dataset.parent / "tok", RECORDS, 0.25)


def run(root, out, extra: dict, method: str = "dpo"):
    """Two DPO steps of the tiny Llama; (the last metrics record, the planner's stage for the same config)."""
    last = train(root, out, {"runner_config.stop_step": 2, **extra})[-1]
    cfg = load_config(None, tiny_overrides(root / "data", out, {"preference_config.method": method, **extra}))
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


@pytest.fixture(scope="module")
def examples(tiny_dataset, tmp_path_factory):
    """The tiny Llama and unpaired KTO examples (tests/cli/test_preference_train.py's)."""
    return preference_run_dir(tmp_path_factory.mktemp("kto_mem"), tiny_dataset.parent / "tok", KTO_RECORDS, 0.25)


KTO = {"preference_config.method": "kto", "preference_config.loss_type": "kto", "preference_config.beta": 0.5}


@pytest.mark.parametrize("reference", ["copy", "adapter"])
def test_planner_counts_ktos_kl_rows_as_the_meter_measures_them(examples, tmp_path, reference):
    """A KTO example is two rows: its own and its KL row (its prompt with another example's completion), both
    through the policy's step and the reference's forward; before the step the policy runs forward only over the
    KL rows for z0 (the KL pass): half the reference's forward. (`precomputed` is refused for KTO.)"""
    extra = {**KTO, "preference_config.reference": reference, **(LORA if reference == "adapter" else {})}
    last, stage = run(examples, tmp_path / "run", extra, "kto")
    assert compare(last, stage.memory) == []  # the policy's activations: two rows an example
    cfg = load_config(None, tiny_overrides(examples / "data", tmp_path / "x", extra))
    dims = ParallelDims.from_config(cfg, 1)
    one_row = plan_memory(cfg, dims, 2, 1)[0].activations_bytes  # had each example been one row
    assert stage.memory.activations_bytes > 1.8 * one_row
    kl = last["mem_kl_forward_bytes"]
    tokens = 2 * 2 * cfg.model.model_config.seq_length  # 2 examples, 2 rows each
    assert kl > 0 and abs(reference_forward_bytes(cfg, dims, tokens // 2, True) - kl) <= ACTIVATIONS_RTOL * kl
    weights, forward = last["mem_reference_bytes"], last["mem_reference_forward_bytes"]
    assert abs(stage.second.weights_bytes - weights) <= STATES_RTOL * max(weights, 1)
    assert (weights == 0) == (reference == "adapter")
    assert abs(stage.second.forward_bytes - forward) <= ACTIVATIONS_RTOL * forward  # all rows: more than the KL pass
    assert 1.8 * kl < forward < 2.2 * kl
    states = last["mem_params_bytes"] + last["mem_grads_bytes"] + last["mem_optim_bytes"]
    assert last["peak_mem_bytes"] == states + weights + max(last["mem_activations_bytes"], forward)
