"""QLoRA's bad input (models/qlora.py, config/validate.py): one line on stderr, exit code 2, before any step."""

from __future__ import annotations

import pytest

from conftest import fails
from test_bad_input import train_argv

M = "model.model_config."


@pytest.mark.parametrize(
    "extra, needles",
    [
        ({M + "pet_config.quantize_base": "nf4"}, ("quantize_base=nf4", "pet_type: lora", "pet_method: qlora")),
        ({M + "pet_method": "lora", M + "pet_config.quantize_base": "nf5"}, ("quantize_base", "nf4")),
        ({M + "pet_method": "qlora", "parallel_config.model_parallel": 2}, ("model_parallel=2", "NF4")),
        (
            {M + "pet_method": "qlora", "parallel_config.data_parallel": 4, "optimizer.optimizer_parallel": 2},
            ("optimizer_parallel=2 of data_parallel=4 (HSDP)", "one mesh dimension"),
        ),
        # k_proj is 20 x 40 = 800 weights: not a whole number of 64-weight blocks
        (
            {M + "pet_method": "qlora", M + "hidden_size": 40, M + "pet_config.target_modules": "[q_proj, k_proj]"},
            ("k_proj (20 x 40)", "blocks of 64", "target_modules"),
        ),
    ],
    ids=["nf4 without lora", "unknown quantize_base", "tensor parallel", "hsdp", "width not a whole block"],
)
def test_qlora_bad_input_is_one_line(tiny_dataset, tmp_path, capsys, extra, needles):
    fails(capsys, train_argv(tiny_dataset, tmp_path / "run", extra), *needles)
    assert not (tmp_path / "run" / "checkpoint").exists()
