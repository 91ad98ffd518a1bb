"""Shared fixtures: a tokenizer and a packed dataset made once per session from the shipped Shakespeare text."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import meshformer.models  # noqa: F401  (the families register their config classes before any config loads)

ROOT = Path(__file__).resolve().parents[1]
CORPUS = sorted((ROOT / "data" / "shakespeare").glob("*.txt"))
DIST = ROOT / "tests" / "dist"  # what torchrun launches: the parity harness and its workers
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FP32_RTOL = 1e-5  # an fp32 parallel run against the single process: relative, per step
EMPTY = str(Path(__file__).parent / "empty.yaml")  # a config file with nothing in it: every value from the overrides
# A small transformers Llama config (the rest of a family's config on top); untied, so lm_head is its own tensor.
HF_SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# The tiny dataset's model shape (tiny_overrides), as a transformers Llama config.
TINY_HF_LLAMA = {
    **HF_SMALL,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e4,
}
# A LoRA fine-tune of an imported tiny model, as its overrides (the PEFT interop tests share it).
LORA = {
    "model.model_config.pet_config.pet_type": "lora",
    "model.model_config.pet_config.lora_rank": 4,
    "model.model_config.pet_config.lora_alpha": 8,
    "model.model_config.pet_config.target_modules": "[q_proj, v_proj, down_proj]",
    "model.model_config.rms_norm_eps": 1e-5,
    "optimizer.learning_rate": 1e-2,
    "runner_config.stop_step": 4,
}


# A conversation with a system prompt and two assistant turns.
TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Green, like grass."},
]


def torchrun_env() -> dict:
    """The environment a test's torchrun launch gets: one OpenMP thread per rank, no inherited WORLD_SIZE."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def refused(capsys, rc: int, *needles: str) -> str:
    """Assert exit code 2 and one line on stderr naming every needle; return the line."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("meshformer: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def fails(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI; assert exit 2 and one line naming every needle; return the line."""
    from meshformer.cli.main import main

    capsys.readouterr()
    return refused(capsys, main(argv), *needles)


def save_hf_model(
    out: Path,
    tokenizer_dir: Path,
    config: dict,
    family: str = "Llama",
    *,
    spread: float = 0.05,
    shard: str | None = None,
    before_save=None,
):
    """A randomly initialised transformers `{family}ForCausalLM` of config (seed 0, weights spread by `spread` times
    N(0, 1) beyond init, then `before_save(model)` under no_grad), saved to out (in shards of `shard` if given) with
    the tokenizer files of tokenizer_dir; returns the model, in eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**config)).eval()
    with torch.no_grad():
        if spread:
            for p in model.parameters():
                p.add_(torch.randn_like(p) * spread)
        if before_save is not None:
            before_save(model)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, Path(out) / name)
    return model


def dpo_overrides(root: Path, out: Path, extra: dict) -> list[str]:
    """Overrides of a tiny DPO run on preference_run_dir(root)'s pairs, starting from its Hugging Face model."""
    extra = {
        "load_checkpoint": str(root / "hf"),
        "train_dataset.data_loader.type": "PreferenceDataset",
        "train_dataset.batch_size": 2,
        "model.model_config.rms_norm_eps": 1e-5,
        "preference_config.method": "dpo",
        **extra,
    }
    return tiny_overrides(root / "data", out, extra)


def preference_run_dir(root: Path, tokenizer_dir: Path, records: list[dict], val_fraction: float) -> Path:
    """root with a transformers-made tiny Llama (`hf`, TINY_HF_LLAMA) and `records` preprocessed as preference
    pairs (`data`); returns root."""
    from meshformer.cli.main import main

    save_hf_model(root / "hf", tokenizer_dir, TINY_HF_LLAMA)
    src = root / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(root / "data")]
    assert main([*argv, "--val-fraction", str(val_fraction)]) == 0
    return root


def tokens():
    """A fixed batch of 2 x 24 token ids below 512."""
    import torch

    return torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


def imports_with_its_logits(reference, src: Path, out: Path, capsys):
    """`import --verify` src to out; assert meshformer's logits there are reference's (transformers) within 1e-4
    (fp32) on tokens(); return (the tokens, reference's logits, the imported checkpoint's config)."""
    import torch

    from meshformer.cli.main import main
    from meshformer.interop.inference import load_for_inference

    x = tokens()
    with torch.no_grad():
        want = reference(x).logits
    assert main(["import", str(src), "--output", str(out), "--verify"]) == 0
    assert "max |logit difference|" in capsys.readouterr().out
    ours, cfg, _ = load_for_inference(out)
    with torch.no_grad():
        got = ours(x)
    assert want.abs().amax() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with capsys.disabled():  # the figure docs/finetune.md quotes (`pytest -s`)
        print(f"import {src.name}: max |logit difference| {(got - want).abs().amax().item():.1e}")
    return x, want, cfg


def hf_tensors(d: Path) -> dict:
    """Every tensor of a Hugging Face directory's safetensors files (the weights, shards merged)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(d).glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def exports_as_the_original(src: Path, ckpt: Path, out: Path, x, want, shard: str = "150KB"):
    """`export` ckpt to out (in shards of `shard`); assert transformers reloads it with no missing, unexpected or
    mismatched weights and `want` logits on x (fp32, 1e-4), and that out holds src's tensors name for name, bit for
    bit; returns the reloaded model."""
    import torch
    import transformers

    from meshformer.cli.main import main

    assert main(["export", str(ckpt), "--output", str(out), "--shard-size", shard]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x).logits, want, rtol=1e-4, atol=1e-4)
    original, exported = hf_tensors(src), hf_tensors(out)
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    return back


def transformers_render(template: str, messages, add_generation_prompt: bool) -> str:
    """What transformers' `apply_chat_template` renders for template (a word-level tokenizer, bos <s>, eos </s>)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "x": 2}, unk_token="x")),
        bos_token="<s>",
        eos_token="</s>",
    )
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@pytest.fixture(scope="session")
def one_process_run():
    """variant -> (per-step results, memory record) of the parity harness's single-process run of that variant
    (tests/dist/harness.py run_case), each variant run once per session: the parity files' references share them."""
    if str(DIST) not in sys.path:
        sys.path.insert(0, str(DIST))
    import harness

    runs = {}

    def run(variant: str) -> tuple[list, dict]:
        if variant not in runs:
            out, _, memory = harness.run_case(None, variant, world_size=1)
            runs[variant] = (out, memory)
        return runs[variant]

    return run


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """Two plays, byte-level BPE with 512 tokens, packed; returns the dataset directory."""
    from meshformer.data.preprocess import preprocess
    from meshformer.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tinydata")
    files = [str(p) for p in CORPUS[:2]]
    train_tokenizer(files, 512, str(root / "tok"))
    preprocess(files, str(root / "tok"), str(root / "data"), val_fraction=0.05)
    return root / "data"


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_dataset) -> Path:
    """The tiny dataset's tokenizer (byte-level BPE, 512 tokens, ChatML template)."""
    return tiny_dataset.parent / "tok"


def full_batch_overrides(batch: int, steps: int, lr: float) -> dict:
    """A meshformer run compared with a TRL trainer step for step: the whole data set as one batch in file order,
    a constant learning rate without warm-up or weight decay (tiny_overrides' other settings stay)."""
    return {
        "train_dataset.batch_size": batch,
        "train_dataset.data_loader.shuffle": False,
        "runner_config.stop_step": steps,
        "optimizer.learning_rate": lr,
        "optimizer.warmup_steps": 0,
        "lr_schedule.type": "constant",
        "optimizer.weight_decay": 0.0,
        "model.model_config.rms_norm_eps": 1e-5,
    }


def trl_full_batch_args(out: Path, batch: int, steps: int, lr: float) -> dict:
    """The TRL side of full_batch_overrides: its config's arguments for meshformer's AdamW (betas 0.9/0.95, eps
    1e-8), clipping at 1, a loss logged every step, fp32 on the CPU (TRL's configs default to bf16 autocast)."""
    return dict(
        output_dir=str(out), per_device_train_batch_size=batch, max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, dataloader_drop_last=True, bf16=False,
    )  # fmt: skip


def tiny_overrides(dataset: Path, out: Path, extra: dict | None = None) -> list[str]:
    """Command-line style overrides for a ~60k-parameter model that trains in milliseconds per step."""
    base = {
        "model.model_config.hidden_size": 32,
        "model.model_config.num_layers": 2,
        "model.model_config.num_heads": 4,
        "model.model_config.n_kv_heads": 2,
        "model.model_config.intermediate_size": 64,
        "model.model_config.vocab_size": 512,
        "model.model_config.seq_length": 32,
        "train_dataset.data_loader.dataset_dir": str(dataset),
        "train_dataset.batch_size": 4,
        "output_dir": str(out),
        "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_steps": 3,
        "monitor_config.peak_flops": 1e12,
        "monitor_config.progress_bar": "plain",
        "callbacks": "[{type: MFLossMonitor, per_print_times: 100}, "
        "{type: CheckpointMonitor, save_checkpoint_steps: 1000}]",
    }
    base.update(extra or {})
    args = []
    for k, v in base.items():
        args += [f"--{k}", str(v)]
    return args


def checksums(root: Path) -> dict[str, str]:
    """Every file below root (but a run's lock, which only says who runs) -> its SHA-256."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }
