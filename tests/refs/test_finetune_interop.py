"""Fine-tuning interoperability, proven against the reference tools (Mistral's import, with or
without its sliding window: tests/refs/test_mistral.py): an exported LoRA adapter names its Hugging Face base,
so `peft.AutoPeftModelForCausalLM` loads it from its folder alone with meshformer's logits; eval_dataset.batch_size
lets a validation split smaller than the training micro-batch evaluate, with the loss computed directly; --verify's
help quotes the tolerance it applies; torch.profiler's kineto markers stay out of training logs."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import LORA, TINY_HF_LLAMA, save_hf_model, tiny_overrides, tokens
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.interop.inference import load_for_inference
from meshformer.train.trainer import run_training

transformers = pytest.importorskip("transformers")


def test_hub_cache_snapshots_are_named_by_their_id():
    from meshformer.interop.convert import hf_base_name

    snapshot = "/home/u/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/12ab34cd"
    assert hf_base_name(snapshot) == "HuggingFaceTB/SmolLM2-135M"
    assert hf_base_name(snapshot + "/") == "HuggingFaceTB/SmolLM2-135M"
    assert hf_base_name("/data/models--x--y/snapshots/r/sub") == "/data/models--x--y/snapshots/r/sub"
    assert hf_base_name("relative/dir") == os.path.abspath("relative/dir")


def test_exported_adapter_loads_with_auto_peft_from_its_folder_alone(tmp_path, tiny_dataset, tokenizer_dir, capsys):
    peft = pytest.importorskip("peft")
    src = tmp_path / "hf"
    base = save_hf_model(src, tokenizer_dir, TINY_HF_LLAMA)
    # The base goes through an import, so the record must travel import -> fine-tune -> export.
    assert main(["import", str(src), "--output", str(tmp_path / "ckpt")]) == 0
    extra = {**LORA, "load_checkpoint": str(tmp_path / "ckpt")}
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "adapter")]) == 0
    assert "AutoPeftModelForCausalLM" in capsys.readouterr().out
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(src.absolute())

    ours, _, _ = load_for_inference(tmp_path / "run")  # base + adapters: what the merged export holds
    x = tokens()
    with torch.no_grad():
        want = ours(x)
        assert (want - base(x).logits).abs().max() > 1e-3  # the adapters learned something
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"), dtype=torch.float32)
        torch.testing.assert_close(loaded.eval()(x).logits, want, rtol=1e-4, atol=1e-4)

    # The base moved: --base names where it is now, and AutoPeft follows it there.
    moved = tmp_path / "moved_base"
    shutil.copytree(src, moved)
    shutil.rmtree(src)
    cmd = ["export", str(tmp_path / "run"), "--output", str(tmp_path / "adapter2"), "--base", str(moved)]
    assert main(cmd) == 0
    assert json.loads((tmp_path / "adapter2" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        moved
    )
    with torch.no_grad():
        again = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter2"), dtype=torch.float32)
        torch.testing.assert_close(again.eval()(x).logits, want, rtol=1e-4, atol=1e-4)


def test_eval_batch_size_lets_a_small_validation_split_evaluate(tmp_path, tiny_dataset):
    from meshformer.data.dataset import open_dataset

    val = open_dataset(tiny_dataset, "validation", 32, "eval_dataset")
    micro = 256  # a training micro-batch larger than the whole validation split
    assert len(val) < micro
    extra = {
        "train_dataset.batch_size": micro,
        "runner_config.stop_step": 1,
        "do_eval": True,
        "eval_config.eval_iters": 100,
    }
    with pytest.raises(UserError, match="set eval_dataset.batch_size lower"):
        run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "refused", extra)))

    last = run_training(
        load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", {**extra, "eval_dataset.batch_size": 16}))
    )
    # One eval iteration: the first 16 * floor(len / 16) validation samples in order, through the saved weights.
    model, _, _ = load_for_inference(tmp_path / "run")
    n = len(val) // 16 * 16
    rows = torch.stack([val[i] for i in range(n)])
    with torch.no_grad():
        logits = model(rows[:, :-1]).float()
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).item()
    assert abs(last["eval_loss"] - want) <= 1e-5 * abs(want), (last["eval_loss"], want)


def test_verify_help_quotes_the_tolerance_it_applies(capsys):
    from meshformer.interop import parity
    from meshformer.tolerance import RELATIVE_TOLERANCE, TOLERANCE

    for command in ("import", "export"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"exit 1 above {TOLERANCE:g}, or {RELATIVE_TOLERANCE:g} x the largest |logit|" in text, text
    small = parity.Parity(0.0, 3.0, 1.0, 1.0, 1)
    large = parity.Parity(0.0, 300.0, 1.0, 1.0, 1)
    assert small.tolerance == TOLERANCE and large.tolerance == pytest.approx(RELATIVE_TOLERANCE * 300.0)


def test_profiler_markers_are_silenced_and_other_stderr_kept(tmp_path, tiny_dataset, capfd):
    from torch.profiler import profile

    from meshformer.observe.profile import _without_kineto_markers

    capfd.readouterr()
    with profile() as prof:  # torch's own start and stop, bare: kineto's markers reach stderr
        torch.ones(2).sum()
    assert re.search(r"USDT:.*profiler_start", capfd.readouterr().err), "kineto no longer prints its markers"
    with _without_kineto_markers():
        prof = profile()
        prof.__enter__()
        os.write(2, b"a real warning\n")
    with _without_kineto_markers():
        prof.__exit__(None, None, None)
    err = capfd.readouterr().err
    assert "a real warning" in err and "USDT" not in err, err

    extra = {"runner_config.stop_step": 2, "callbacks": "[{type: MFLossMonitor, per_print_times: 1}]"}
    run_training(load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", extra)))
    out = capfd.readouterr()
    assert "USDT" not in out.err + out.out and "step 2" in out.out + out.err
