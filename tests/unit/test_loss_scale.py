"""fp16 with dynamic loss scaling: an overflow skips the step and halves the scale, the run goes on (and learns);
finite windows grow the scale; the scale is saved with the checkpoint; MindSpore's scale_sense forms parse and
bad ones are one line. fp16 against fp32 and bf16 under every layout is in the parity suite (variant fp16)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.train.loss_scale import LossScaler


def test_an_overflow_skips_the_step_halves_the_scale_and_the_run_goes_on(tiny_dataset, tmp_path):
    from meshformer.train.trainer import run_training

    extra = {
        "model.model_config.compute_dtype": "float16",
        # 2^30 x (1 / tokens per step) overflows fp16's 65504 in the logits' gradient: the first steps must skip
        "runner_wrapper.scale_sense": "{type: DynamicLossScaleUpdateCell, loss_scale_value: 1073741824, "
        "scale_factor: 2, scale_window: 4}",
        "runner_config.stop_step": 30,
        "callbacks": "[{type: CheckpointMonitor, save_checkpoint_steps: 1000}]",
    }
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 30  # the run went on: overflows are not the data's fault (max_consecutive_skips is 3)
    skipped = [
        r["step"] for r, prev in zip(recs, [{"skipped_steps": 0}, *recs]) if r["skipped_steps"] > prev["skipped_steps"]
    ]
    assert skipped[:3] == [1, 2, 3] and len(skipped) < 20
    # Every step's scale follows the rule from the skips: /2 after an overflow, x2 after 4 finite steps in a row.
    replay = LossScaler(2.0**30, dynamic=True, factor=2, window=4)
    for r in recs:
        assert r["loss_scale"] == replay.scale, r
        replay.update(r["step"] not in skipped)
    scales = [r["loss_scale"] for r in recs]
    assert any(b > a for a, b in zip(scales, scales[1:]))  # it grew again after the overflows
    first_good = next(r for r in recs if r["step"] not in skipped)
    assert recs[-1]["loss"] < first_good["loss"]  # and it learns
    # The checkpoint keeps the scale the next step would use and its count of good steps (exact resume).
    state = json.loads(next((tmp_path / "run" / "checkpoint").glob("step_*/trainer_state.json")).read_text())
    assert (state["loss_scale"], state["loss_scale_good_steps"]) == (replay.scale, replay.good_steps)


def _cfg(**over):
    args = [x for k, v in over.items() for x in (f"--{k}", str(v))]
    return load_config(None, args)


def test_scale_sense_forms():
    fp16 = {"model.model_config.compute_dtype": "float16"}
    default = LossScaler.from_config(_cfg(**fp16))
    assert default.dynamic and default.scale == 65536 and default.window == 1000
    assert not LossScaler.from_config(_cfg()).dynamic and LossScaler.from_config(_cfg()).scale == 1.0
    fixed = LossScaler.from_config(_cfg(**{"runner_wrapper.scale_sense": 1024}))
    assert fixed.scale == 1024 and not fixed.dynamic
    s = LossScaler(8.0, dynamic=True, factor=2, window=2)
    for finite in (True, True, False, True):
        s.update(finite)
    assert (s.scale, s.good_steps) == (8.0, 1)  # x2 after two good steps, /2 at the overflow


@pytest.mark.parametrize(
    "value, needle",
    [
        ("{type: StaticLossScale}", "unknown type 'StaticLossScale'"),
        ("{type: DynamicLossScaleUpdateCell, scale_factr: 2}", "unknown key 'scale_factr'"),
        ("{loss_scale_value: 0}", "loss_scale_value must be > 0"),
        ("-4", "a loss scale must be > 0"),
    ],
)
def test_bad_scale_sense_is_one_line(capsys, value, needle):
    capsys.readouterr()
    assert main(["config", "check", str(ROOT / "tests" / "empty.yaml"), "--runner_wrapper.scale_sense", value]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
