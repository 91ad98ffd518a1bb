"""report_to's spellings, the numbers a tracker is given, and the registry's names (no tracker package needed)."""

from __future__ import annotations

import math

import pytest

from conftest import EMPTY
from meshformer.config import load_config
from meshformer.config.tracker_schema import TRACKERS, report_to_names
from meshformer.errors import UserError
from meshformer.observe.trackers import REGISTRY, tracker_values


@pytest.mark.parametrize(
    "given, names",
    [
        (["tensorboard"], ["tensorboard"]),
        ("wandb", ["wandb"]),
        ("swanlab, WandB", ["wandb", "swanlab"]),  # Hugging Face's comma string; TRACKERS' order
        (["mlflow", "mlflow"], ["mlflow"]),
        ("all", list(TRACKERS)),
        ("none", []),
        ([], []),
    ],
)
def test_report_to_spellings(given, names):
    assert report_to_names(given) == names


def test_report_to_defaults_to_tensorboard_and_loads_from_the_command_line():
    assert load_config(EMPTY).report_to == ["tensorboard"]
    assert load_config(EMPTY, ["--report_to", "[wandb, mlflow]"]).report_to == ["wandb", "mlflow"]
    with pytest.raises(UserError, match="did you mean 'swanlab'"):
        load_config(EMPTY, ["--report_to", "swanlb"])


def test_every_named_tracker_is_built_by_the_registry():
    assert tuple(REGISTRY) == TRACKERS


def test_a_tracker_gets_every_number_of_the_row_but_the_step():
    row = {"step": 3, "loss": 2.5, "tokens_per_s": 10, "eval_loss": None, "lr": math.nan, "flag": True, "note": "x"}
    assert tracker_values(row) == {"loss": 2.5, "tokens_per_s": 10}
