"""Bad `report_to` input: one line, exit 2, before any work (output_dir never made): a tracker name that does not
exist (with a guess), and a tracker whose package is not installed (naming the pip extra that installs it)."""

from __future__ import annotations

import sys

import pytest

from conftest import EMPTY, fails, tiny_overrides


@pytest.mark.parametrize(
    "report_to, needle",
    [
        ("wandbb", "did you mean 'wandb'?"),
        ("[tensorboard, mlfow]", "did you mean 'mlflow'?"),
        ("tensorbord,swanlab", "did you mean 'tensorboard'?"),
        ("[comet]", "choose from tensorboard, wandb, mlflow, swanlab, all or none"),
    ],
)
def test_an_unknown_tracker_is_one_line_with_a_guess(tiny_dataset, tmp_path, capsys, report_to, needle):
    out = tmp_path / "run"
    fails(capsys, ["train", EMPTY, *tiny_overrides(tiny_dataset, out, {"report_to": report_to})], "report_to", needle)
    assert not out.exists()


@pytest.mark.parametrize("name", ["wandb", "mlflow", "swanlab"])
def test_a_tracker_not_installed_is_one_line_naming_its_extra(tiny_dataset, tmp_path, capsys, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # what `import name` sees when the package is not installed
    out = tmp_path / "run"
    argv = ["train", EMPTY, *tiny_overrides(tiny_dataset, out, {"report_to": f"[tensorboard, {name}]"})]
    fails(capsys, argv, f"report_to: {name} is not installed", f"pip install 'meshformer[{name}]'")
    assert not out.exists()
