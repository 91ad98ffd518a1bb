"""MindSpore Transformers' parameter names for the Llama family (its LlamaForCausalLM, which also runs Qwen2 / Qwen2.5
with `qkv_has_bias`), both ways, including its fused projections.

The names are those of MindSpore Transformers' converters (mindformers/models/llama/convert_weight.py and
convert_reversed.py, research/qwen2_5/convert_weight.py): `model.tok_embeddings.embedding_weight`,
`model.layers.N.attention.wq/wk/wv/wo.weight` (+ q/k/v `.bias`), `feed_forward.w1` (gate) / `w2` (down) / `w3` (up),
`attention_norm`, `ffn_norm`, `model.norm_out.weight`, `lm_head.weight` (absent when the head is tied). Hugging
Face sources are converted without a q/k permutation, so the rotary layout is transformers' (and ours).

With `qkv_concat: True` a layer holds `attention.w_qkv` and `feed_forward.w_gate_hidden` instead, in the layout its
`qkv_concat_hf2mg` / `ffn_concat_hf2mg` (mindformers/utils/convert_utils.py) make (Megatron's): w_qkv's rows are
grouped per key/value head, each group the query rows of the heads sharing it, then that head's key rows, then its
value rows (the q/k/v biases alike); w_gate_hidden's rows alternate gate row i, up row i. MindSpore's functions take
the query width to be hidden_size; here it is num_heads x head_dim, which is the same for every model they convert.
"""

from __future__ import annotations

import re

import torch

from meshformer.errors import UserError

GLOBAL_NAMES = {  # ours -> MindSpore Transformers'
    "embed_tokens.weight": "model.tok_embeddings.embedding_weight",
    "norm.weight": "model.norm_out.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_PARTS = {  # the part of `layers.N.<part>.weight|bias` -> the part of `model.layers.N.<part>.weight|bias`
    "input_layernorm": "attention_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
}
FUSED_QKV = "attention.w_qkv"
FUSED_GATE_UP = "feed_forward.w_gate_hidden"
QKV_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP_PARTS = ("mlp.gate_proj", "mlp.up_proj")

_OURS = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_FROM_PART = {theirs: ours for ours, theirs in LAYER_PARTS.items()}


def mindspore_name(ours: str) -> str:
    """MindSpore Transformers' name of one of our parameters (unfused); one line for one it has no name for."""
    if ours in GLOBAL_NAMES:
        return GLOBAL_NAMES[ours]
    m = _OURS.fullmatch(ours)
    if m is None or m[2] not in LAYER_PARTS:
        raise UserError(
            f"parameter {ours} has no MindSpore Transformers name (its Llama/Qwen2 models have no such weight, "
            f"e.g. Qwen3's q/k norms): export this model with --format hf or gguf"
        )
    return f"model.layers.{m[1]}.{LAYER_PARTS[m[2]]}.{m[3]}"


def _heads(mc) -> tuple[int, int, int]:
    """(key/value heads, query heads per key/value head, head width)."""
    return mc.num_kv_heads, mc.num_heads // mc.num_kv_heads, mc.dim_per_head


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mc) -> torch.Tensor:
    """w_qkv (or its bias) from q/k/v in Hugging Face's layout: per key/value head, its queries, key, value."""
    kv, rep, d = _heads(mc)
    tail = q.shape[1:]
    parts = (q.reshape(kv, rep * d, -1), k.reshape(kv, d, -1), v.reshape(kv, d, -1))
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(w: torch.Tensor, mc) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv, rep, d = _heads(mc)
    tail = w.shape[1:]
    q, k, v = torch.split(w.reshape(kv, (rep + 2) * d, -1), [rep * d, d, d], dim=1)
    return tuple(x.reshape(-1, *tail).clone(memory_format=torch.contiguous_format) for x in (q, k, v))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """w_gate_hidden from gate and up: their rows alternating."""
    return torch.stack((gate, up), dim=1).reshape(-1, gate.shape[1])


def split_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = w.reshape(-1, 2, w.shape[1])
    return tuple(pairs[:, i].clone(memory_format=torch.contiguous_format) for i in (0, 1))


def _fused_rows(part: str, mc) -> int:
    if part == FUSED_QKV:
        return (mc.num_heads + 2 * mc.num_kv_heads) * mc.dim_per_head
    return 2 * mc.ffn_hidden_size


def _unfuse(name: str, layer: str, part: str, kind: str, t: torch.Tensor, mc, where: str) -> dict[str, torch.Tensor]:
    rows = _fused_rows(part, mc)
    want = [rows] if kind == "bias" else [rows, mc.hidden_size]
    if list(t.shape) != want:
        raise UserError(
            f"{where}: tensor {name} is {list(t.shape)}, but the model_config describes {want} (num_heads="
            f"{mc.num_heads}, n_kv_heads={mc.num_kv_heads}, head width {mc.dim_per_head}, ffn width "
            f"{mc.ffn_hidden_size}, hidden_size={mc.hidden_size}): give the YAML the checkpoint was trained with"
        )
    if part == FUSED_QKV:
        pieces, ours = split_qkv(t, mc), QKV_PARTS
    elif kind == "weight":
        pieces, ours = split_gate_up(t), GATE_UP_PARTS
    else:
        raise UserError(f"{where}: tensor {name}: the Llama family's MLP has no bias")
    return {f"layers.{layer}.{o}.{kind}": p for o, p in zip(ours, pieces)}


def from_mindspore(tensors: dict[str, torch.Tensor], mc, where: str) -> dict[str, torch.Tensor]:
    """Our names for a MindSpore Transformers checkpoint's tensors, fused projections split; one line naming the
    first tensor that is no parameter of this family."""
    globals_back = {theirs: ours for ours, theirs in GLOBAL_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _THEIRS.fullmatch(name)
        if name in globals_back:
            out[globals_back[name]] = t
        elif m is not None and m[2] in _FROM_PART:
            out[f"layers.{m[1]}.{_FROM_PART[m[2]]}.{m[3]}"] = t
        elif m is not None and m[2] in (FUSED_QKV, FUSED_GATE_UP):
            out.update(_unfuse(name, m[1], m[2], m[3], t, mc, where))
        else:
            raise UserError(
                f"{where}: tensor {name!r} is no MindSpore Transformers Llama/Qwen2 parameter (they are named like "
                f"model.layers.0.attention.wq.weight): import a checkpoint of one of these families, in the names "
                f"its convert_weight.py writes"
            )
    return out


def to_mindspore(state: dict[str, torch.Tensor], mc, fused: bool = False) -> dict[str, torch.Tensor]:
    """MindSpore Transformers' names for our parameters; with `fused` each layer's q/k/v (weights, and biases when
    there are) as one w_qkv and its gate/up as one w_gate_hidden, in qkv_concat_hf2mg / ffn_concat_hf2mg's layout."""
    out = {mindspore_name(k): v for k, v in state.items()}
    if not fused:
        return out
    for layer in range(mc.num_layers):
        pre = f"model.layers.{layer}."
        for kind in ("weight", "bias"):
            q, k, v = (f"{pre}{LAYER_PARTS[p]}.{kind}" for p in QKV_PARTS)
            if q in out:
                out[f"{pre}{FUSED_QKV}.{kind}"] = fuse_qkv(out.pop(q), out.pop(k), out.pop(v), mc)
        gate, up = (f"{pre}{LAYER_PARTS[p]}.weight" for p in GATE_UP_PARTS)
        if gate in out:
            out[f"{pre}{FUSED_GATE_UP}.weight"] = fuse_gate_up(out.pop(gate), out.pop(up))
    return out
