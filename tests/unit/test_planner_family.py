"""The planner asks the model family for activations (models/activations.py): the Llama family's formulas
(models/llama/activations.py) and the counter a family without them gets (planner/counted_activations.py) check
each other, and a family defined in this file alone is planned by counting and matches what its real step
measures (train/memory.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from torch import nn

from conftest import tiny_overrides
from meshformer.config import load_config
from meshformer.config.model_schema import type_field
from meshformer.config.schema import ModelConfig
from meshformer.models.llama import Attention, LlamaConfig, RMSNorm, RopeTables
from meshformer.models.registry import ModelFamily, family_of, register_family, unregister_family
from meshformer.parallel.dims import ParallelDims
from meshformer.planner import memory
from meshformer.planner.counted_activations import COUNTED
from test_model_family import GeluMLP  # the non-gated MLP with biases, shared with the family test

TINY = {
    "model.model_config.hidden_size": 64,
    "model.model_config.num_layers": 3,
    "model.model_config.num_heads": 4,
    "model.model_config.vocab_size": 256,
    "model.model_config.seq_length": 32,
    "model.model_config.intermediate_size": 96,
}
BF16 = {"model.model_config.compute_dtype": "bfloat16"}
GQA = {"model.model_config.n_kv_heads": 2}
TP2_SP = {"parallel_config.model_parallel": 2, "parallel_config.use_seq_parallel": True}
LLAMA_CASES = {
    "fp32": {},
    "bf16 autocast": BF16,
    "GQA": GQA,
    "q/k norm, tied, bf16": {
        **BF16,
        "model.model_config.use_qk_norm": True,
        "model.model_config.tie_word_embeddings": True,
    },
    "lora, bf16": {**BF16, **GQA, "model.model_config.pet_method": "lora"},
    "tp2 + SP, GQA": {**TP2_SP, **GQA},
    "tp2, bf16": {**BF16, "parallel_config.model_parallel": 2},
    "dp2 bf16 (gathered weights)": {**BF16, "parallel_config.data_parallel": 2},
    "alternate matmuls, GQA": {**GQA, "recompute_config.select_recompute_policy": "alternate_matmuls"},
    "alternate matmuls, lora, bf16": {
        **BF16,
        "model.model_config.pet_method": "lora",
        "recompute_config.select_recompute_policy": "alternate_matmuls",
    },
    "alternate matmuls, tp2 + SP": {**TP2_SP, "recompute_config.select_recompute_policy": "alternate_matmuls"},
}


def _config(extra: dict):
    argv = [x for k, v in {**TINY, **extra}.items() for x in (f"--{k}", str(v))]
    cfg = load_config(None, argv)
    pc = cfg.parallel_config
    return cfg, ParallelDims.from_config(cfg, pc.data_parallel * pc.model_parallel * pc.pipeline_stage)


def _shape(cfg, dims, micro_batch: int) -> memory.ActivationShape:
    """What stage_memory hands the activation model (its residual-stream rules)."""
    mc = cfg.model.model_config
    n, a = memory._size(mc.layernorm_compute_dtype), memory._size(mc.compute_dtype)
    autocast = mc.compute_dtype != mc.param_init_type
    residual = a if (autocast and dims.dp > 1) or not autocast else memory._size(mc.param_init_type)
    sp = cfg.parallel_config.use_seq_parallel and dims.tp > 1
    policy = cfg.recompute_config.select_recompute_policy
    return memory.ActivationShape(
        micro_batch, mc.seq_length, dims.tp, sp, n, a, residual, residual > a, autocast, select_policy=policy
    )


@pytest.mark.parametrize("name", list(LLAMA_CASES))
def test_the_counter_agrees_with_the_llama_formulas(name):
    """Every figure the planner asks of a layer, formula against a count of one fake forward of the real modules.
    Exact but for one term the formula leaves out and a real step saves (train/memory.py counts it): apply_rotary's
    sign-flipped sin table, a fresh [seq, head_dim] float32 tensor for q and for k, kept by the product with the
    swapped halves; batch-independent (2 x 4096 x 128 x 4 B = 4 MiB per layer of a 7B at 4k tokens, against GiBs),
    and the counter cuts it by t with the rest of attention."""
    from meshformer.parallel.tp import resolve_plan

    cfg, dims = _config(LLAMA_CASES[name])
    mc = cfg.model.model_config
    llama = family_of(mc).activation_model
    assert llama is not None and llama is not COUNTED  # the Llama family brings its formulas
    shape = _shape(cfg, dims, micro_batch=2)
    rotary_table = 2 * mc.seq_length * mc.dim_per_head * 4 // dims.tp
    ((_, piece),) = memory._pieces(cfg, dims, 0)
    styles = resolve_plan(piece, family_of(mc).tp_plan(piece)) if dims.tp > 1 else {}
    grad_in = any(p.requires_grad for p in piece.embed_tokens.parameters())
    formula = llama.piece_activations(mc, piece, shape, grad_in, False, styles)
    counted = COUNTED.piece_activations(mc, piece, shape, grad_in, False, styles)
    assert counted.counted and not formula.counted
    assert list(counted.layers) == list(formula.layers) == [str(i) for i in range(mc.num_layers)]
    for key, want in formula.layers.items():
        got = counted.layers[key]
        assert got.saved == want.saved + rotary_table, (key, got.saved - want.saved)
        assert (got.grad_out, got.full_recompute, got.selective) == (want.grad_out, want.full_recompute, want.selective)
    assert counted.head.saved == formula.head.saved > 0
    if "lora" in name:  # nothing before the first LoRA linear trains: layer 0 keeps less than the others
        assert formula.layers["0"].saved < formula.layers["1"].saved


def test_the_planner_uses_the_counter_where_a_family_has_no_activation_model():
    """The same Llama layout planned with the family's formulas and with its activation model taken away: the
    figures differ by the rotary tables alone, and the counted plan says it was counted."""
    cfg, dims = _config({**BF16, "recompute_config.select_recompute": [1]})
    formula = memory.plan_memory(cfg, dims, 2, 1)[0]
    llama = family_of(cfg.model.model_config)
    unregister_family(llama.name)
    register_family(dataclasses.replace(llama, activation_model=None))
    try:
        counted = memory.plan_memory(cfg, dims, 2, 1)[0]
    finally:
        unregister_family(llama.name)
        register_family(llama)
    mc = cfg.model.model_config
    assert counted.activations_counted and not formula.activations_counted
    assert counted.as_dict()["activations_counted"] is True
    rotary_tables = (mc.num_layers - 1) * 2 * mc.seq_length * mc.dim_per_head * 4  # the selective layer keeps none
    assert counted.activations_bytes - formula.activations_bytes == rotary_tables
    assert (counted.recompute_bytes - formula.recompute_bytes) == 2 * mc.seq_length * mc.dim_per_head * 4
    assert dataclasses.replace(counted, activations_counted=False, activations_bytes=0, recompute_bytes=0) == (
        dataclasses.replace(formula, activations_bytes=0, recompute_bytes=0)
    )


# ---- a family the planner has no formula for, defined and registered here ---------------------------------------

TOY_TYPE = "ToyPlannedConfig"


@dataclasses.dataclass
class ToyPlannedConfig(LlamaConfig):
    """Llama's fields (the toy reuses Llama's attention), its own type."""

    type: str = type_field(TOY_TYPE)


class ToyLayer(nn.Module):
    """Llama's attention and RMSNorm, LayerNorm before the GELU MLP: no formula of the planner's fits it."""

    def __init__(self, mc: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.self_attn = Attention(mc)
        self.mlp_norm = nn.LayerNorm(mc.hidden_size, eps=mc.rms_norm_eps)
        self.mlp = GeluMLP(mc)

    def forward(self, x, rope, start=0, cache=None, positions=None, mask=None):
        x = x + self.self_attn(self.attn_norm(x), rope, start, cache, self.layer_idx, positions, mask)
        return x + self.mlp(self.mlp_norm(x))


class ToyModel(nn.Module):
    def __init__(self, mc: ModelConfig):
        super().__init__()
        self.config = mc
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleDict({str(i): ToyLayer(mc, i) for i in range(mc.num_layers)})
        self.norm = nn.LayerNorm(mc.hidden_size, eps=mc.rms_norm_eps)
        self.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
        self.rope = RopeTables(mc)

    def forward(self, h, cache=None, documents=None):
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def toy_tp_plan(model) -> dict[str, str]:
    layer = {"attn_norm": "norm", "self_attn": "gather_sequence", "self_attn.o_proj": "rowwise"}
    layer |= {f"self_attn.{p}_proj": "colwise" for p in "qkv"}
    layer |= {"mlp_norm": "norm", "mlp": "gather_sequence", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}
    plan = {"embed_tokens": "vocab_embedding", "norm": "norm", "lm_head": "vocab_head"}
    return plan | {f"layers.*.{path}": style for path, style in layer.items()}


def toy_param_count(mc: ModelConfig) -> int:
    h, f, q, kv = mc.hidden_size, mc.ffn_hidden_size, mc.num_heads * mc.dim_per_head, mc.num_kv_heads * mc.dim_per_head
    layer = h * q + 2 * h * kv + q * h + 2 * h * f + f + h + 3 * h
    return 2 * mc.vocab_size * h + mc.num_layers * layer + 2 * h


def _no_hf(*_):
    raise NotImplementedError("the planner's toy family has no Hugging Face form")


TOY = ModelFamily(
    name="toy_planned",
    config_types={TOY_TYPE: ToyPlannedConfig},
    hf_model_types={},
    build=ToyModel,
    tp_plan=toy_tp_plan,
    param_count=toy_param_count,
    config_from_hf=_no_hf,
    config_to_hf=_no_hf,
)  # no activation_model: the planner counts


@pytest.fixture
def toy_family():
    register_family(TOY)
    yield TOY
    unregister_family(TOY.name)


TOY_CASES = {
    "fp32": {},
    "bf16 autocast": BF16,
    "selective recompute": {"recompute_config.select_recompute": True},
    "selective, alternate matmuls": {
        "recompute_config.select_recompute": True,
        "recompute_config.select_recompute_policy": "alternate_matmuls",
    },
    "full recompute, bf16": {**BF16, "recompute_config.recompute": True, "train_dataset.batch_size": 1},
}


@pytest.mark.parametrize("name", list(TOY_CASES))
def test_a_family_without_formulas_is_planned_by_counting_and_matches_its_measured_step(
    toy_family, tiny_dataset, tmp_path, name
):
    """test_memory.py's check for Llama, for the toy family: one real training step's measured bytes by component
    (train/memory.py) against the plan, activations within the planner's tolerance."""
    from meshformer.planner.accelerators import ACCELERATORS
    from meshformer.planner.explain import explain
    from meshformer.planner.plan import make_plan
    from meshformer.train.trainer import run_training
    from test_memory import compare

    extra = {"model.model_config.type": TOY_TYPE, "runner_config.stop_step": 2, "model.model_config.seq_length": 64}
    cfg = load_config(None, tiny_overrides(tiny_dataset, tmp_path / "run", {**extra, **TOY_CASES[name]}))
    assert family_of(cfg.model.model_config) is TOY
    last = run_training(cfg)
    dims = ParallelDims.from_config(cfg, 1)
    predicted = memory.plan_memory(cfg, dims, cfg.train_dataset.batch_size, 1)[0]
    assert predicted.activations_counted
    assert compare(last, predicted) == [], (name, last["mem_activations_bytes"], predicted.activations_bytes)
    # tighter than the planner's tolerance: the count runs the modules the step runs
    assert abs(predicted.activations_bytes / last["mem_activations_bytes"] - 1) < 1e-3
    report = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert report["0"]["activations_bytes"] == last["mem_activations_bytes"] > 0
    plan = make_plan(cfg, dims, ACCELERATORS["H100"], cfg.train_dataset.batch_size, 1)
    assert any("counted, not a formula" in line for line in explain(plan))


def test_a_counted_family_plans_a_tensor_and_pipeline_parallel_layout(toy_family):
    """tp2 + SP over two pipeline stages of the toy family: each stage's layers counted, the head on the last
    only, and a layer's set cut by the plan's styles: more than half of the unsplit layer's (the column-parallel
    linears keep their whole gathered input), less than all of it."""
    from meshformer.parallel.tp import resolve_plan

    toy = {"model.model_config.type": TOY_TYPE}
    cfg, dims = _config({**toy, **TP2_SP, "parallel_config.pipeline_stage": 2, "parallel_config.micro_batch_num": 4})
    stages = memory.plan_memory(cfg, dims, 2, 4)
    assert [s.layers for s in stages] == [1, 2] and all(s.activations_counted for s in stages)
    assert all(s.activations_bytes > 0 for s in stages)
    ((_, last_stage),) = memory._pieces(cfg, dims, 1)
    styles = resolve_plan(last_stage, toy_tp_plan(last_stage))
    split = COUNTED.piece_activations(cfg.model.model_config, last_stage, _shape(cfg, dims, 2), True, False, styles)
    whole_cfg, whole_dims = _config(toy)
    ((_, whole),) = memory._pieces(whole_cfg, whole_dims, 0)
    unsplit = COUNTED.piece_activations(
        whole_cfg.model.model_config, whole, _shape(whole_cfg, whole_dims, 2), True, False, {}
    )
    assert split.head is not None and unsplit.head is not None
    assert unsplit.layers["2"].saved / 2 < split.layers["2"].saved < unsplit.layers["2"].saved
    assert split.layers["2"].full_recompute * 2 == unsplit.layers["2"].full_recompute  # SP: a sequence shard
