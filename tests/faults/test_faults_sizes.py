"""Faults of model-building sizes and import validation: an absurd size (a num_layers, hidden_size, vocab_size,
intermediate_size or expert_num typo) is refused in seconds, in one line naming the field and the bytes, on every
path that builds a model (train, plan, doctor, import from Hugging Face, GGUF and MindSpore, generate, eval, export);
impossible MoE config.json routing, a tied YAML over a MindSpore head of its own, an eval window past the model's
positions and non-positive plan / doctor numbers are refused in one line, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

import meshformer.models  # noqa: F401  (imported here, so a test's wall time is its own work, not imports)
import meshformer.planner.plan  # noqa: F401
import meshformer.train.trainer  # noqa: F401
from conftest import EMPTY, HF_SMALL, TINY_HF_LLAMA, checksums, fails, save_hf_model, tiny_overrides
from meshformer.checkpoint.manifest import write_manifest
from meshformer.cli.main import main

SECONDS = 5  # an absurd size is refused within this, before memory is allocated
BIG = {  # field -> a value whose model cannot fit any machine (over a petabyte of float32 weights)
    "num_layers": 10**9,
    "hidden_size": 10**7,
    "vocab_size": 10**13,
    "intermediate_size": 10**11,
}
MOE = {
    "model.model_config.type": "Qwen3MoeConfig",
    "model.model_config.moe_config.expert_num": 4,
    "model.model_config.moe_config.num_experts_chosen": 2,
    "model.model_config.moe_config.moe_intermediate_size": 32,
}
BIG_MOE = {**BIG, "moe_config.expert_num": 10**11, "moe_config.moe_intermediate_size": 10**11}
del BIG_MOE["intermediate_size"]  # every layer is sparse: the dense width builds nothing


def quickly(capsys, argv: list[str], *needles: str) -> str:
    """`fails` (exit 2, one line naming every needle) within SECONDS; an alarm stops a hang (the old code's minutes
    of building layers) as a failure instead of a stuck test."""

    def hung(*_):
        raise TimeoutError(f"{argv[0]} still running after 20 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        start = time.perf_counter()
        line = fails(capsys, argv, *needles)
        elapsed = time.perf_counter() - start
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert elapsed < SECONDS, (elapsed, line)
    return line


def overrides(tiny_dataset, tmp_path, moe: bool, field: str, value: int) -> list[str]:
    return tiny_overrides(
        tiny_dataset, tmp_path / "run", {**(MOE if moe else {}), f"model.model_config.{field}": value}
    )


# ---- train, plan, doctor -------------------------------------------------------------------------------------
CASES = [(False, f, v) for f, v in BIG.items()] + [(True, f, v) for f, v in BIG_MOE.items()]


@pytest.mark.parametrize("moe, field, value", CASES)
def test_train_refuses_an_absurd_size_in_seconds(moe, field, value, tiny_dataset, tmp_path, capsys):
    argv = ["train", EMPTY, *overrides(tiny_dataset, tmp_path, moe, field, value)]
    quickly(capsys, argv, f"{field.rpartition('.')[2]}={value}", "GiB per rank")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("moe, field, value", CASES)
def test_plan_refuses_an_absurd_size_in_seconds(moe, field, value, tiny_dataset, tmp_path, capsys):
    argv = ["plan", EMPTY, *overrides(tiny_dataset, tmp_path, moe, field, value)]
    quickly(capsys, argv, f"{field.rpartition('.')[2]}={value}", "GiB for the weights alone", "--devices")


@pytest.mark.parametrize("command", ["doctor", "plan"])
def test_doctor_and_search_refuse_an_absurd_moe_num_layers(command, tiny_dataset, tmp_path, capsys):
    extra = ["--search"] if command == "plan" else []
    argv = [command, EMPTY, *extra, *overrides(tiny_dataset, tmp_path, True, "num_layers", 10**7)]
    quickly(capsys, argv, "num_layers=10000000", "GiB for the weights alone")


def test_moe_parameter_count_is_the_built_models_without_building_every_layer():
    """The count a size check rests on: one layer of each kind times how many there are, exact."""
    import dataclasses

    from meshformer.config.load import load_config
    from meshformer.models import build_model, family_of, num_params

    for name in ("demo_moe", "plan_deepseek_v2_lite", "plan_qwen3_30b_a3b"):
        mc = load_config(str(Path(__file__).parents[2] / "configs" / f"{name}.yaml")).model.model_config
        for layers, first, step, dense in [(5, 0, 1, []), (7, 2, 1, [4]), (9, 1, 2, [3, 5, 6]), (6, 0, 3, [2])]:
            moe = dataclasses.replace(
                mc.moe_config, first_k_dense_replace=first, decoder_sparse_step=step, mlp_only_layers=dense
            )
            small = dataclasses.replace(mc, num_layers=layers, moe_config=moe)
            assert family_of(small).param_count(small) == num_params(build_model(small)), (name, layers)
            assert small.moe_layer_count == sum(small.is_moe_layer(i) for i in range(layers))
        start = time.perf_counter()
        huge = dataclasses.replace(mc, num_layers=10**9)
        assert family_of(huge).param_count(huge) > 10**12 and huge.moe_layer_count > 10**9 - 10
        assert time.perf_counter() - start < 1


# ---- import: Hugging Face, GGUF, MindSpore -------------------------------------------------------------------
def hf_dir(root: Path, tokenizer_dir: Path, config: dict) -> Path:
    """A Hugging Face directory whose config.json is `config` and whose weights are one small tensor."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 8)}, str(root / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, root / name)
    return root


LLAMA_JSON = {**HF_SMALL, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
QWEN3_MOE_JSON = {
    **HF_SMALL,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
HF_BIG = [
    (LLAMA_JSON, "num_hidden_layers", 10**9),
    (LLAMA_JSON, "hidden_size", 10**7),
    (LLAMA_JSON, "vocab_size", 10**13),
    (LLAMA_JSON, "intermediate_size", 10**11),
    (QWEN3_MOE_JSON, "num_hidden_layers", 10**9),
    (QWEN3_MOE_JSON, "num_experts", 10**11),
    (QWEN3_MOE_JSON, "moe_intermediate_size", 10**11),
]


@pytest.mark.parametrize("config, key, value", HF_BIG)
def test_import_refuses_a_config_json_of_absurd_size(config, key, value, tmp_path, tokenizer_dir, capsys):
    src = hf_dir(tmp_path / "hf", tokenizer_dir, {**config, key: value})
    before = checksums(tmp_path)
    quickly(capsys, ["import", str(src), "--output", str(tmp_path / "out")], f"{key}={value}", "GiB", "config")
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()


def test_import_refuses_a_config_json_claiming_more_than_its_weights_in_seconds(tmp_path, tokenizer_dir, capsys):
    """20,000 layers of a small model fit in memory, but building them takes minutes: the count says it first."""
    src = hf_dir(tmp_path / "hf", tokenizer_dir, {**QWEN3_MOE_JSON, "num_hidden_layers": 20000})
    quickly(capsys, ["import", str(src), "--output", str(tmp_path / "out")], "num_hidden_layers=20000", "hold 64")


def test_gguf_import_refuses_a_header_of_absurd_size(tmp_path, monkeypatch, capsys):
    test_gguf = pytest.importorskip("test_gguf")
    written, _ = test_gguf.llama_tensors()
    monkeypatch.setattr(test_gguf, "LAYERS", 10**9)  # llama.block_count in the header
    path = test_gguf.write_gguf(tmp_path / "big.gguf", "llama", written)
    quickly(capsys, ["import", str(path), "--output", str(tmp_path / "out")], "num_hidden_layers=1000000000", "GiB")
    assert not (tmp_path / "out").exists()


def _mindspore(tmp_path: Path, tokenizer_dir: Path, tied_yaml: bool, **yaml_changes) -> tuple[Path, Path]:
    """(a MindSpore checkpoint of a tiny untied Llama, its MindSpore Transformers YAML with yaml_changes)."""
    ms_test = pytest.importorskip("test_mindspore_ckpt")
    reference = ms_test.hf_model("Llama", dict(num_key_value_heads=2))
    ckpt = ms_test.save_ms(ms_test.mindspore_weights(reference, fused=False), tmp_path / "model.ckpt")
    config = ms_test.mindformers_yaml(tmp_path / "run.yaml", reference.config, tokenizer_dir, False)
    data = yaml.safe_load(config.read_text())
    data["model"]["model_config"].update(yaml_changes, tie_word_embeddings=tied_yaml)
    config.write_text(yaml.safe_dump(data))
    return ckpt, config


@pytest.mark.parametrize("field, value", list(BIG.items()))
def test_mindspore_import_refuses_a_yaml_of_absurd_size(field, value, tmp_path, tokenizer_dir, capsys):
    ckpt, config = _mindspore(tmp_path, tokenizer_dir, False, **{field: value})
    argv = ["import", str(ckpt), "--config", str(config), "--output", str(tmp_path / "out")]
    quickly(capsys, argv, f"{field}={value}", "GiB", "run.yaml")


def test_mindspore_import_refuses_a_tied_yaml_over_a_head_of_its_own(tmp_path, tokenizer_dir, capsys):
    ckpt, config = _mindspore(tmp_path, tokenizer_dir, True)
    before = checksums(tmp_path)
    argv = ["import", str(ckpt), "--config", str(config), "--output", str(tmp_path / "out")]
    fails(capsys, argv, "tie_word_embeddings", "lm_head.weight", "tie_word_embeddings: false")
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()


# ---- impossible MoE config.json ------------------------------------------------------------------------------
IMPOSSIBLE = {  # name: (config.json changes, what the line names)
    "mlp_only_layers_past_the_end": ({"mlp_only_layers": [0, 7]}, ["mlp_only_layers", "[7]", "num_hidden_layers=2"]),
    "every_layer_dense": ({"mlp_only_layers": [0, 1]}, ["no layer is sparse", "mlp_only_layers"]),
    "decoder_sparse_step_0": (
        {"decoder_sparse_step": 0},
        ["decoder_sparse_step=0", "set 1 to make"],
    ),
    "decoder_sparse_step_past_the_end": ({"decoder_sparse_step": 3}, ["no layer is sparse", "decoder_sparse_step=3"]),
}
DEEPSEEK_JSON = {
    **HF_SMALL,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
}
IMPOSSIBLE_DEEPSEEK = {
    "n_group_not_dividing": ({"n_group": 3}, ["n_group=3", "n_routed_experts=8", "divisor"]),
    "top_k_over_experts": ({"num_experts_per_tok": 9}, ["num_experts_per_tok=9", "n_routed_experts=8"]),
    "topk_group_over_n_group": ({"topk_group": 4}, ["topk_group=4", "n_group=2"]),
    "first_k_dense_past_the_end": ({"first_k_dense_replace": 2}, ["first_k_dense_replace=2", "num_hidden_layers=2"]),
}


@pytest.mark.parametrize(
    "base, name", [(QWEN3_MOE_JSON, n) for n in IMPOSSIBLE] + [(DEEPSEEK_JSON, n) for n in IMPOSSIBLE_DEEPSEEK]
)
def test_import_refuses_impossible_moe_routing_in_config_json(base, name, tmp_path, tokenizer_dir, capsys):
    changes, needles = {**IMPOSSIBLE, **IMPOSSIBLE_DEEPSEEK}[name]
    src = hf_dir(tmp_path / "hf", tokenizer_dir, {**base, **changes})
    before = checksums(tmp_path)
    fails(capsys, ["import", str(src), "--output", str(tmp_path / "out")], "config", *needles)
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()


# ---- generate, eval, export of a checkpoint whose config.yaml is absurd ----------------------------------------
@pytest.fixture
def tiny_checkpoint(tmp_path, tokenizer_dir) -> Path:
    save_hf_model(tmp_path / "hf", tokenizer_dir, TINY_HF_LLAMA)
    assert main(["import", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    return tmp_path / "ckpt"


def _absurd(ckpt: Path) -> None:
    """num_layers: 1000000000 in the checkpoint's config.yaml."""
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["model"]["model_config"]["num_layers"] = 10**9
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    write_manifest(ckpt)  # as if it had been saved so: the checksums agree, only the size is absurd


@pytest.mark.parametrize("command", ["generate", "eval", "export", "export_mindspore"])
def test_a_checkpoint_config_of_absurd_size_is_refused_in_seconds(command, tiny_checkpoint, tmp_path, capsys):
    _absurd(tiny_checkpoint)
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.")
    argv = {
        "generate": ["generate", "--checkpoint", str(tiny_checkpoint), "--prompt", "To be", "--max-new-tokens", "2"],
        "eval": ["eval", "--checkpoint", str(tiny_checkpoint), "--input", str(text)],
        "export": ["export", str(tiny_checkpoint), "--output", str(tmp_path / "out")],
        "export_mindspore": [
            "export",
            str(tiny_checkpoint),
            "--format",
            "mindspore",
            "--output",
            str(tmp_path / "out.ckpt"),
        ],
    }[command]
    quickly(capsys, argv, "config.yaml", "num_layers=1000000000", "GiB")
    assert not list(tmp_path.glob("out*"))


def test_eval_refuses_a_window_past_the_models_positions(tiny_checkpoint, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    argv = ["eval", "--checkpoint", str(tiny_checkpoint), "--input", str(text), "--seq-length", "1000000"]
    fails(capsys, argv, "--seq-length 1000000", "32")
    capsys.readouterr()
    assert main([*argv[:-1], "32"]) == 0  # the model's own length still evaluates


# ---- plan and doctor arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("doctor", "--target-samples-per-s", "-5"),
        ("doctor", "--target-samples-per-s", "0"),
        ("doctor", "--target-samples-per-s", "nan"),
        ("doctor", "--target-samples-per-s", "inf"),
        ("plan", "--devices", "0"),
        ("plan", "--devices", "-8"),
        ("plan", "--device-memory", "nan"),
        ("plan", "--device-memory", "inf"),
        ("doctor", "--device-memory", "nan"),
    ],
)
def test_plan_and_doctor_refuse_non_positive_numbers(command, flag, value, tiny_dataset, tmp_path, capsys):
    argv = [command, EMPTY, flag, value, *tiny_overrides(tiny_dataset, tmp_path / "run")]
    fails(capsys, argv, f"{flag} {value}")
