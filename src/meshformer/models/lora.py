"""LoRA (low-rank adapters) as a model transform: `model.model_config.pet_config` with `pet_type: lora`.

Each target linear W becomes `LoRALinear`: y = W x + (lora_alpha / lora_rank) * B A dropout(x), with A (r x d_in)
drawn like PEFT's (uniform in +-1/sqrt(d_in)) and B (d_out x r) zero, so training starts from the base model's
outputs. Everything else is frozen (requires_grad False): the optimizer holds only the adapters.

Names follow PEFT's: the wrapped linear is `base_layer`, the factors `lora_A` and `lora_B`, so a checkpoint key is
`layers.0.self_attn.q_proj.lora_A.weight` and PEFT's adapter file key is the same path under
`base_model.model.model.`. Loading base weights into a LoRA model maps `q_proj.weight` to `q_proj.base_layer.weight`
(`base_name`).

Mixture-of-Experts models: attention, dense MLPs and shared experts are linears and take adapters; routed experts
(stacked 3-D parameters, `mlp.experts.gate_proj` [E, F, D]) and routers never do. A target that matches them as well
as linears adapts the linears only; one that matches nothing but experts or routers is refused in one line. PEFT
adapter keys are the family's Hugging Face module names. peft 0.21 on transformers 5 reads the targets gate_proj /
up_proj / down_proj of an MoE model as its routed experts (`_convert_peft_config_moe`, made for adapters trained on
transformers 4's per-expert linears), so an MoE adapter on dense or shared-expert MLPs has no PEFT form: `export`
refuses it in one line and `--merge-lora` writes the full model instead.

Tensor parallelism (`tp_subplan`): for a column-parallel W (q/k/v, gate/up) A is replicated and B split by output
rows like W, so B A x lands on the same output shard; for a row-parallel W (o, down) A is split by input columns
like W (its r-wide partial sums are all-reduced: r numbers per token, not d_out) and B replicated.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from meshformer.config.schema import MeshformerConfig
from meshformer.errors import UserError

# MindSpore Transformers' Llama layer names -> ours (its LoRA configs target `.*wq|.*wk|.*wv|.*wo`).
MINDSPORE_NAMES = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
}
LORA_PARTS = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    # False: the layer is its base layer alone (adapters_off: a preference run's reference without a second copy)
    adapters_on = True

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kw)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        for p in base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_on:
            return self.base_layer(x)
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def tp_subplan(self, style: str) -> dict[str, str]:
        if style == "colwise":
            return {"base_layer": "colwise", "lora_A": "replicated", "lora_B": "colwise"}
        if style == "rowwise":
            return {"base_layer": "rowwise", "lora_A": "rowwise_to_replicated", "lora_B": "replicated_to_output"}
        raise ValueError(f"LoRA on a {style} layer is not supported (only column- and row-parallel linears)")


@contextlib.contextmanager
def adapters_off(modules: Iterable[nn.Module]):
    """Every LoRA layer inside `modules` runs as its base layer alone for the duration: the model the adapters
    started from, with no second copy of its weights."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, LoRALinear)]
    for layer in layers:
        layer.adapters_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_on = True


def lora_init(name: str, shape: tuple, generator: torch.Generator) -> torch.Tensor | None:
    """The initial value of a LoRA factor (None for other parameters): A as PEFT draws it, B zero."""
    parent = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if parent == "lora_B":
        return torch.zeros(shape)
    if parent == "lora_A":  # kaiming_uniform_(a=sqrt(5)), PEFT's default: bound 1/sqrt(fan_in)
        bound = 1 / math.sqrt(shape[1])
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound
    return None


def target_matcher(targets: str | list) -> callable:
    """module path -> is it a target? A regex (fullmatch, MindSpore style) or a list of names (PEFT style: the
    path ends with the name)."""
    if isinstance(targets, list):
        names = [MINDSPORE_NAMES.get(str(t), str(t)) for t in targets]
        return lambda path: any(path == n or path.endswith("." + n) for n in names)
    pattern = re.sub(r"\bw[qkvo123]\b", lambda m: MINDSPORE_NAMES[m.group(0)], targets)
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise UserError(f"model.model_config.pet_config.target_modules={targets!r}: not a valid regex ({e})") from None
    return lambda path: compiled.fullmatch(path) is not None


def apply_lora(model: nn.Module, cfg: MeshformerConfig) -> None:
    pc = cfg.model.model_config.pet_config
    matches = target_matcher(pc.target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = 0
    for path, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and ".layers." in f".{path}" and matches(path):
            parent_path, _, child = path.rpartition(".")
            setattr(
                model.get_submodule(parent_path),
                child,
                LoRALinear(module, pc.lora_rank, pc.lora_alpha, pc.lora_dropout),
            )
            wrapped += 1
    if not wrapped:
        moe = [n for n, _ in model.named_parameters() if ".mlp.experts." in n or n.endswith(".mlp.gate.weight")]
        hit = next((n for n in moe if matches(n) or matches(n.removesuffix(".weight"))), None)
        if hit is not None:
            raise UserError(
                f"model.model_config.pet_config.target_modules={pc.target_modules!r} matches only routed experts or "
                f"routers ({hit}): they are stacked parameters, not linears, and take no LoRA; target attention, "
                f"dense MLPs or shared experts, e.g. [q_proj, k_proj, v_proj, o_proj]"
            )
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(
            f"model.model_config.pet_config.target_modules={pc.target_modules!r} matches no decoder linear "
            f"(their names: {', '.join(names)}); e.g. '.*q_proj|.*v_proj' or [q_proj, v_proj]"
        )


def lora_wanted(cfg: MeshformerConfig) -> bool:
    return cfg.model.model_config.pet_config.pet_type == "lora"


def is_lora_key(key: str) -> bool:
    return any(f".{part}." in key for part in LORA_PARTS)


def base_name(key: str) -> str | None:
    """A LoRA model's state-dict key -> the base model's key (None for the adapters themselves)."""
    return None if is_lora_key(key) else key.replace(".base_layer.", ".")


PEFT_ROOT = "base_model.model."  # PEFT wraps the *ForCausalLM: its keys are this + Hugging Face's names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in: W + (alpha / r) B A (what PEFT's merge does); a
    QLoRA base's W is its dequantized NF4 weight (models/qlora.py NF4Linear.dequantized)."""
    state = {base_name(k): v for k, v in model.state_dict().items() if base_name(k) is not None}
    for path, layer in lora_layers(model).items():
        delta = (layer.lora_B.weight.float() @ layer.lora_A.weight.float()) * layer.scaling
        key = f"{path}.weight"
        base = layer.base_layer
        weight = base.dequantized() if hasattr(base, "dequantized") else state[key]
        state[key] = (weight.float() + delta).to(weight.dtype)
    return state


def peft_adapter(model: nn.Module, cfg: MeshformerConfig, base: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors tensors) as PEFT writes them for a causal LM; `base` is the
    Hugging Face id or directory AutoPeftModelForCausalLM loads the base model from (None: unknown, as PEFT writes
    it for a model not loaded from the hub)."""
    from meshformer.models.registry import family_of

    mc = cfg.model.model_config
    pc = mc.pet_config
    layers = lora_layers(model)
    family = family_of(mc)
    mlp = next((path for path in layers if ".mlp." in path), None)
    if family.moe and mlp is not None:
        raise UserError(
            f"a PEFT adapter of {mc.type} cannot hold {mlp}: peft (0.21, transformers 5) reads an MoE model's "
            f"gate_proj/up_proj/down_proj targets as its routed experts, so it would load onto other weights; export "
            f"with --merge-lora (the full model), or adapt attention only (target_modules: [q_proj, k_proj, v_proj, "
            f"o_proj])"
        )
    tensors = {}
    for path, layer in layers.items():
        # the linear's Hugging Face module path: the family's names (`model.` + ours for Llama)
        hf_path = next(iter(family.to_hf_state({f"{path}.weight": layer.lora_A.weight}, mc))).removesuffix(".weight")
        for part in LORA_PARTS:
            tensors[f"{PEFT_ROOT}{hf_path}.{part}.weight"] = getattr(layer, part).weight.detach()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": pc.lora_rank,
        "lora_alpha": pc.lora_alpha,
        "lora_dropout": pc.lora_dropout,
        "target_modules": sorted({path.rsplit(".", 1)[-1] for path in layers}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    return config, tensors
