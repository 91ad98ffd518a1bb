"""What every model family's test file checks the same way (tests/refs/test_{mistral,gemma3,glm4,gpt_oss}.py):
a reproducible text, logits within a relative bound, packed rows against each sample alone, a LoRA fine-tune's PEFT
adapter against our logits, and the planner against one real training step."""

from __future__ import annotations

import torch

from conftest import LORA, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.interop.inference import load_for_inference

PACKED_LENGTHS = [[13, 27], [21, 9, 10]]  # two rows of 40 tokens, several documents each


def text(n: int = 40, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(seed))


def assert_rel(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    """Within rtol relative to the largest |want| (fp32 logits)."""
    assert (got - want).abs().max() <= rtol * want.abs().max(), float((got - want).abs().max() / want.abs().max())


@torch.no_grad()
def assert_packed_rows_equal_each_sample_alone(model, x: torch.Tensor) -> None:
    """The rows of x packed with PACKED_LENGTHS' documents give each document's logits as if it ran alone."""
    documents = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in PACKED_LENGTHS])
    packed = model(x, documents=documents)
    for row, sizes in enumerate(PACKED_LENGTHS):
        start = 0
        for n in sizes:
            alone = model(x[row : row + 1, start : start + n])
            torch.testing.assert_close(packed[row : row + 1, start : start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def lora_fine_tune_and_export(ckpt, tiny_dataset, tmp_path, extra: dict | None = None) -> tuple:
    """A LoRA fine-tune (run_mode finetune, `extra` overrides on top) of the imported checkpoint `ckpt`, exported as
    a PEFT adapter: (the run directory, the adapter directory)."""
    from meshformer.cli.train_cmd import run_training

    extra = {**LORA, "load_checkpoint": str(ckpt), "run_mode": "finetune", **(extra or {})}
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)))
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "adapter")]) == 0
    return tmp_path / "run", tmp_path / "adapter"


@torch.no_grad()
def assert_peft_gives_our_logits(run, adapter, x: torch.Tensor) -> tuple:
    """peft's AutoPeftModelForCausalLM on the exported adapter gives the fine-tuned checkpoint's logits (1e-4);
    returns (our config, our logits, peft's model) for the caller's own checks."""
    import peft

    ours, cfg, _ = load_for_inference(run)
    want = ours(x)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32)
    torch.testing.assert_close(loaded.eval()(x).logits, want, rtol=1e-4, atol=1e-4)
    return cfg, want, loaded


def assert_plan_matches_a_training_step(tiny_dataset, tmp_path, extra: dict, within: float | None = 1e-3) -> None:
    """One real training step's measured bytes by component (train/memory.py) against the plan (test_memory.py's
    check), activations counted on the real modules, and `within` that share of the step's (None: the check's own
    bound only)."""
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner import memory
    from meshformer.train.trainer import run_training
    from test_memory import compare

    cfg = load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", {**extra, "runner_config.stop_step": 2}))
    last = run_training(cfg)
    predicted = memory.plan_memory(cfg, ParallelDims.from_config(cfg, 1), cfg.train_dataset.batch_size, 1)[0]
    assert predicted.activations_counted  # on the real modules
    assert compare(last, predicted) == [], (last["mem_activations_bytes"], predicted.activations_bytes)
    if within is not None:
        assert abs(predicted.activations_bytes / last["mem_activations_bytes"] - 1) < within
