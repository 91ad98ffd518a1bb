"""fp8_config's bad input: one line, exit code 2, before any step (config/fp8_schema.py, parallel/float8.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import fails
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.parallel.env import ParallelEnv
from meshformer.parallel.float8 import check_float8_device
from test_bad_input import train_argv

FP8 = {"fp8_config.enable": True, "model.model_config.compute_dtype": "bfloat16"}


@pytest.mark.parametrize(
    "extra, needles",
    [
        (
            {"fp8_config.enable": True},  # compute_dtype float32, the default
            ("fp8_config.enable=true with model.model_config.compute_dtype=float32", "compute_dtype: bfloat16"),
        ),
        (
            {**FP8, "model.model_config.compute_dtype": "float16"},
            ("compute_dtype=float16", "set compute_dtype: bfloat16"),
        ),
        ({**FP8, "fp8_config.recipe": "tensorwize"}, ("fp8_config.recipe", "tensorwise")),
        (
            {**FP8, "fp8_config.recipe": "rowwise", "fp8_config.enable_fsdp_float8_all_gather": True},
            ("enable_fsdp_float8_all_gather=true with recipe=rowwise", "use recipe: tensorwise"),
        ),
        (
            {**FP8, "fp8_config.precompute_float8_dynamic_scale_for_fsdp": True},
            ("precompute_float8_dynamic_scale_for_fsdp=true", "enable_fsdp_float8_all_gather: true"),
        ),
        ({**FP8, "fp8_config.enable_fsdp_float8_all_gather": True}, ("gloo cannot all-gather float8",)),
        (  # the tiny model's every decoder linear is 32 or 64 wide: a filter that keeps them all converts nothing
            {**FP8, "fp8_config.filter_fqns": "[self_attn, mlp]"},
            ("fp8_config.enable=true converts no linear", "fp8_config.filter_fqns has 'self_attn'"),
        ),
        ({**FP8, "fp8_config.filter_fqns": "['']"}, ("fp8_config.filter_fqns=['']",)),
    ],
)
def test_bad_fp8_input_is_one_line(tiny_dataset, tmp_path, capsys, extra, needles):
    fails(capsys, train_argv(tiny_dataset, tmp_path / "out", extra), *needles)
    assert not (tmp_path / "out" / "checkpoint").exists()


def test_a_gpu_without_fp8_units_is_refused_naming_it(monkeypatch):
    """An A100 (compute capability 8.0) has no FP8 tensor cores: refused in one line naming the card; an H100's
    9.0 passes. The device query is replaced, so this runs on any machine."""
    cfg = load_config(None, ["--fp8_config.enable", "true", "--model.model_config.compute_dtype", "bfloat16"])
    env = ParallelEnv(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    with pytest.raises(UserError, match=r"on NVIDIA A100-SXM4-80GB \(compute capability 8\.0\): FP8 matmuls need 8\.9"):
        check_float8_device(cfg, env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    check_float8_device(cfg, env)  # Hopper: no error
