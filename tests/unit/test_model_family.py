"""The model-family registry: a family defined and registered in this file alone (nothing in src/ names it) trains
through the real trainer, converts to Hugging Face names and back, and plans; param_count and the one FLOPs rule
agree with the built modules for it and for Llama."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from conftest import EMPTY, tiny_overrides
from meshformer.config import load_config
from meshformer.config.model_schema import type_field
from meshformer.config.schema import ModelConfig
from meshformer.dtypes import DTYPE
from meshformer.errors import UserError
from meshformer.models import build_model, create_model, num_params
from meshformer.models.llama import Attention, KVCache, LlamaConfig, RopeTables, document_layout, param_count
from meshformer.models.registry import (
    HF_HEAD,
    ModelFamily,
    families,
    family_for_hf,
    family_of,
    model_config,
    register_family,
    unregister_family,
)

TOY_TYPE, TOY_HF_TYPE, TOY_HF_CLASS = "ToyGeluConfig", "toygelu", "ToyGeluForCausalLM"


@dataclasses.dataclass
class ToyGeluConfig(LlamaConfig):
    """The toy's config class: Llama's fields (it reuses Llama's attention, which reads them), its own type."""

    type: str = type_field(TOY_TYPE)


class GeluMLP(nn.Module):
    """Non-gated: fc_out(gelu(fc_in(x))), with biases (GPT-2's block, unlike Llama's SwiGLU)."""

    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.fc_in = nn.Linear(mc.hidden_size, mc.ffn_hidden_size)
        self.fc_out = nn.Linear(mc.ffn_hidden_size, mc.hidden_size)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class ToyLayer(nn.Module):
    """Pre-LayerNorm block: Llama's attention (reused), LayerNorms without bias, the GELU MLP."""

    def __init__(self, mc: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = nn.LayerNorm(mc.hidden_size, eps=mc.rms_norm_eps, bias=False)
        self.self_attn = Attention(mc)
        self.mlp_norm = nn.LayerNorm(mc.hidden_size, eps=mc.rms_norm_eps, bias=False)
        self.mlp = GeluMLP(mc)

    def forward(self, x, rope, start=0, cache=None, positions=None, mask=None):
        x = x + self.self_attn(self.attn_norm(x), rope, start, cache, self.layer_idx, positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class ToyDecoder(nn.Module):
    """What the registry asks of a model: `.config`, `layers` keyed by global index, embed_tokens / norm / lm_head."""

    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.config = mc
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleDict({str(i): ToyLayer(mc, i) for i in range(mc.num_layers)})
        self.norm = nn.LayerNorm(mc.hidden_size, eps=mc.rms_norm_eps, bias=False)
        self.lm_head = None if mc.tie_word_embeddings else nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.rope = RopeTables(mc)

    def forward(self, h, cache: KVCache | None = None, documents=None):
        start = cache.pos if cache is not None else 0
        positions = mask = None
        if documents is not None:
            positions, mask = document_layout(h.shape[0], h.shape[1], documents, cache, h.device)
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        for layer in self.layers.values():
            h = layer(h, self.rope, start, cache, positions, mask)
        if cache is not None:
            cache.pos += h.shape[1]
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            return self.lm_head(h)
        if self.config.tie_word_embeddings and self.embed_tokens is not None and self.norm is not None:
            return F.linear(h, self.embed_tokens.weight)
        return h


def toy_tp_plan(model) -> dict[str, str]:
    layer = {
        "attn_norm": "norm",
        "self_attn": "gather_sequence",
        **{f"self_attn.{p}_proj": "colwise" for p in "qkv"},
        "self_attn.o_proj": "rowwise",
        "mlp_norm": "norm",
        "mlp": "gather_sequence",
        "mlp.fc_in": "colwise",
        "mlp.fc_out": "rowwise",
    }
    return {
        "embed_tokens": "vocab_embedding",
        "norm": "norm_to_head" if model.config.tie_word_embeddings else "norm",
        "lm_head": "vocab_head",
        **{f"layers.*.{path}": style for path, style in layer.items()},
    }


def toy_param_count(mc: ModelConfig) -> int:
    h, f, q, kv = mc.hidden_size, mc.ffn_hidden_size, mc.num_heads * mc.dim_per_head, mc.num_kv_heads * mc.dim_per_head
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if mc.qkv_has_bias else 0)
    attn += 2 * mc.dim_per_head if mc.use_qk_norm else 0
    layer = attn + (h * f + f) + (f * h + h) + 2 * h
    return mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2) + mc.num_layers * layer + h


# GPT-2's Hugging Face layout: the body is `transformer.`, layers are `h.N`, the final norm `ln_f`.
def toy_to_hf(name: str) -> str:
    if name == HF_HEAD:
        return name
    if name.startswith("layers."):
        return "transformer.h." + name.removeprefix("layers.")
    return {"embed_tokens.weight": "transformer.wte.weight", "norm.weight": "transformer.ln_f.weight"}[name]


def toy_from_hf(name: str) -> str | None:
    if name == HF_HEAD:
        return name
    if name.startswith("transformer.h."):
        return "layers." + name.removeprefix("transformer.h.")
    return {"transformer.wte.weight": "embed_tokens.weight", "transformer.ln_f.weight": "norm.weight"}.get(name)


HF_KEYS = {  # config.json key -> model_config field
    "hidden_size": "hidden_size",
    "n_layer": "num_layers",
    "n_head": "num_heads",
    "num_key_value_heads": "n_kv_heads",
    "n_inner": "intermediate_size",
    "vocab_size": "vocab_size",
    "n_positions": "seq_length",
    "layer_norm_epsilon": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}


def toy_config_from_hf(hf: dict, where: str) -> dict:
    missing = [k for k in HF_KEYS if k not in hf]
    if missing:
        raise UserError(f"{where}: {', '.join(missing)} missing")
    return {"type": TOY_TYPE, **{ours: hf[key] for key, ours in HF_KEYS.items()}}


def toy_config_to_hf(mc: ModelConfig, dtype: str) -> dict:
    derived = {"n_inner": mc.ffn_hidden_size, "num_key_value_heads": mc.num_kv_heads}  # defaults resolved
    hf = {key: derived.get(key, getattr(mc, ours)) for key, ours in HF_KEYS.items()}
    return {"architectures": [TOY_HF_CLASS], "model_type": TOY_HF_TYPE, **hf, "torch_dtype": dtype}


TOY = ModelFamily(
    name="toy_gelu",
    config_types={TOY_TYPE: ToyGeluConfig},
    hf_model_types={TOY_HF_TYPE: TOY_HF_CLASS},
    build=ToyDecoder,
    tp_plan=toy_tp_plan,
    param_count=toy_param_count,
    config_from_hf=toy_config_from_hf,
    config_to_hf=toy_config_to_hf,
    to_hf=toy_to_hf,
    from_hf=toy_from_hf,
)


@pytest.fixture(scope="module", autouse=True)
def toy_family():
    register_family(TOY)
    yield TOY
    unregister_family(TOY.name)
    assert TOY not in families()


def toy_config(**kw) -> ModelConfig:
    shape = dict(hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=64, vocab_size=96)
    return ToyGeluConfig(seq_length=16, **{**shape, **kw})


def test_the_registry_finds_each_family_by_config_type_and_by_hugging_face_architecture():
    assert family_of(toy_config()) is TOY
    assert family_of(model_config(type="Qwen3Config")).name == "llama"
    assert family_for_hf({"architectures": [TOY_HF_CLASS]}, "config.json") == (TOY, TOY_HF_TYPE)
    assert family_for_hf({"model_type": TOY_HF_TYPE}, "config.json") == (TOY, TOY_HF_TYPE)
    with pytest.raises(UserError, match="architecture 'FalconForCausalLM' is not supported") as err:
        family_for_hf({"architectures": ["FalconForCausalLM"]}, "c.json")
    assert TOY_HF_CLASS in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="clashes"):  # a second family may not claim the same config type
        register_family(ModelFamily("other", (TOY_TYPE,), {}, *[None] * 5))


def test_model_config_type_comes_from_the_registry(tmp_path):
    assert load_config(EMPTY, ["--model.model_config.type", TOY_TYPE]).model.model_config.type == TOY_TYPE
    with pytest.raises(UserError, match="did you mean 'ToyGeluConfig'") as err:
        load_config(EMPTY, ["--model.model_config.type", "ToyGeluConfg"])
    assert "\n" not in str(err.value) and "LlamaConfig" in str(err.value)


@pytest.mark.parametrize("tied", [False, True])
def test_param_count_equals_the_built_model(tied):
    shape = dict(hidden_size=48, num_layers=3, num_heads=6, n_kv_heads=2, vocab_size=200, tie_word_embeddings=tied)
    for mc in (toy_config(**shape), model_config(**shape), model_config(type="Qwen2Config", **shape)):
        assert family_of(mc).param_count(mc) == num_params(build_model(mc)), mc.type
    assert param_count(model_config(**shape)) == num_params(build_model(model_config(**shape)))


def test_the_one_flops_rule_counts_a_tied_head_and_both_callers_use_it():
    from meshformer.config.schema import MeshformerConfig
    from meshformer.planner.throughput import flops_per_token as planned

    shape = dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=1000, seq_length=32)
    tied, untied = model_config(**shape, tie_word_embeddings=True), model_config(**shape, tie_word_embeddings=False)
    fpt = family_of(tied).flops_per_token(tied)
    assert fpt == family_of(untied).flops_per_token(untied)  # the same matmuls, whoever owns the head's weight
    matmul = param_count(untied) - 1000 * 64  # every weight but the embedding lookup, the head included
    assert fpt == 6 * matmul + 12 * 2 * 4 * 16 * 32
    cfg = MeshformerConfig()
    cfg.model.model_config = tied
    assert planned(cfg) == fpt  # the trainer's MFU (train/run_metrics.py) calls the family's rule itself
    toy = toy_config()
    assert TOY.flops_per_token(toy) == 6 * (toy_param_count(toy) - 96 * 32) + 12 * 2 * 4 * 8 * 16


@pytest.mark.parametrize("tied", [False, True])
def test_the_toy_tp_plan_covers_every_parameter_exactly_once(tied):
    from meshformer.parallel.tp import make_style, resolve_plan

    model = build_model(toy_config(tie_word_embeddings=tied))
    resolved = resolve_plan(model, TOY.tp_plan(model))
    owned = [f"{m}.{p}" for m in resolved for p, _ in model.get_submodule(m).named_parameters(recurse=False)]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters()), resolved
    assert resolved["layers.1.mlp.fc_in"] == "colwise" and resolved["layers.0.mlp.fc_out"] == "rowwise"
    for style in set(resolved.values()):
        make_style(style, seq_parallel=True)


def test_the_toy_family_trains_through_the_real_trainer(tiny_dataset, tmp_path):
    from meshformer.train.trainer import run_training

    out = tmp_path / "run"
    extra = {"model.model_config.type": TOY_TYPE, "runner_config.stop_step": 12}
    run_training(load_config(None, tiny_overrides(tiny_dataset, out, extra)))
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses  # ln(512) = 6.2 at the start
    saved = load_config(next((out / "checkpoint").glob("step_*")) / "config.yaml")
    assert saved.model.model_config.type == TOY_TYPE


@pytest.mark.parametrize("tied", [False, True])
def test_the_toy_family_converts_to_hugging_face_names_and_back(tmp_path, tied):
    from meshformer.interop.convert import source_to_model
    from meshformer.interop.hf_config import hf_config_from_model, model_config_from_hf
    from meshformer.interop.hf_dir import read_hf_dir, to_hf_names, write_hf_dir

    mc = toy_config(tie_word_embeddings=tied)
    model = create_model(mc, seed=3)
    hf_config = hf_config_from_model(mc, "float32")
    assert hf_config["architectures"] == [TOY_HF_CLASS]
    fields = model_config_from_hf(hf_config, "config.json")
    assert model_config(**fields) == mc

    tensors = to_hf_names(model.state_dict(), TOY)
    assert "transformer.h.1.mlp.fc_in.bias" in tensors and ("lm_head.weight" in tensors) != tied
    write_hf_dir(tmp_path, hf_config, tensors, None, {}, shard_bytes=1 << 30)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
    cfg, back = source_to_model(read_hf_dir(tmp_path))  # the import path: registry, adapter, shape check
    assert cfg.model.model_config.type == TOY_TYPE
    want = model.state_dict()
    assert set(back) == set(want)
    for name, t in want.items():
        assert torch.equal(back[name], t.to(DTYPE[mc.param_init_type])), name


def test_the_toy_family_plans_without_crashing(capsys):
    from meshformer.cli.main import main

    toy = ["--model.model_config.type", TOY_TYPE, "--model.model_config.num_layers", "4"]
    assert main(["plan", EMPTY, "--json", *toy, "--model.model_config.seq_length", "256"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (stage,) = plan["stages"]
    mc = load_config(EMPTY, toy).model.model_config
    assert stage["params_bytes"] == toy_param_count(mc) * 4 and stage["activations_bytes"] > 0
    assert plan["flops_per_token"] == TOY.flops_per_token(model_config(**{**mc.__dict__, "seq_length": 256}))
