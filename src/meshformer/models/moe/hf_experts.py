"""Hugging Face's per-expert tensors <-> our stacked ones, for the MoE families' `from_hf_tensors` / `to_hf_tensors`.

On disk every Hugging Face MoE checkpoint names each expert's matrices apart (`...mlp.experts.3.gate_proj.weight`,
Mixtral's `...block_sparse_moe.experts.3.w1.weight`); ours are stacked [experts, out, in] (`...mlp.experts.gate_proj`)
for grouped matmuls and expert parallelism. `leaves` maps Hugging Face's leaf name to ours, e.g. Mixtral's
{"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.
"""

from __future__ import annotations

import re

import torch

from meshformer.errors import UserError

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<leaf>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>\w+)$")


def stack_experts(tensors: dict[str, torch.Tensor], leaves: dict[str, str]) -> dict[str, torch.Tensor]:
    """Per-expert `P.experts.E.<hf leaf>.weight` tensors -> one stacked `P.experts.<our leaf>` each; every other
    tensor unchanged. A missing or repeated expert is one line naming the tensor."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None or m["leaf"] not in leaves:
            out[name] = t
            continue
        groups.setdefault((m["prefix"], leaves[m["leaf"]]), {})[int(m["expert"])] = t
    for (prefix, leaf), by_expert in groups.items():
        missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
        if missing:
            raise UserError(f"{prefix}: experts {missing[:8]} of {leaf} are missing from the checkpoint")
        shapes = {tuple(t.shape) for t in by_expert.values()}
        if len(shapes) > 1:
            raise UserError(f"{prefix}.*.{leaf}: experts have different shapes {sorted(shapes)}")
        out[f"{prefix}.{leaf}"] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def split_experts(state: dict[str, torch.Tensor], leaves: dict[str, str]) -> dict[str, torch.Tensor]:
    """The inverse of `stack_experts`: stacked `P.experts.<our leaf>` -> `P.experts.E.<hf leaf>.weight`."""
    ours_to_hf = {ours: hf for hf, ours in leaves.items()}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _STACKED.match(name)
        if m is None or m["leaf"] not in ours_to_hf:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            out[f"{m['prefix']}.{e}.{ours_to_hf[m['leaf']]}.weight"] = t[e]
    return out
