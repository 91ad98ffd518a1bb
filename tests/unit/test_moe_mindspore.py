"""MindSpore Transformers' `moe_config` read as its YAML files write it: the block at the top level, every MoE name
it uses landing in meshformer's MoeConfig with the same value, MindSpore-only kernel and dispatcher switches
(routing_policy, enable_sdrop, ...) accepted with one notice each, and meaningless combinations refused in one line
(exit 2 through `meshformer config check`, before anything is built)."""

from __future__ import annotations

import pytest

import meshformer.models  # noqa: F401  (the families register the MoE model types validation names)
from conftest import refused
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.errors import UserError
from meshformer.models.moe.validate import aux_losses

MODEL = """\
model:
  model_config:
    type: Qwen3MoeConfig
    hidden_size: 64
    num_layers: 4
    num_heads: 4
    intermediate_size: 128
"""
# A MindSpore Transformers DeepSeek-V3-style block, every name of its moe_config that meshformer models.
MINDSPORE_MOE = """\
moe_config:
  expert_num: 8
  num_experts_chosen: 2
  moe_intermediate_size: 32
  shared_expert_num: 1
  routed_scaling_factor: 2.5
  norm_topk_prob: True
  use_gating_sigmoid: True
  topk_method: noaux_tc
  n_group: 4
  topk_group: 2
  aux_loss_types: ["expert", "device", "comm"]
  aux_loss_factors: [0.0001, 0.0, 0.0]
  z_loss_factor: 0.001
  balance_via_topk_bias: True
  topk_bias_update_rate: 0.0001
  capacity_factor: 1.5
  first_k_dense_replace: 1
  use_gmm: True
  routing_policy: "TopkRouterV2"
  enable_sdrop: True
  use_fused_ops_topkrouter: True
  npu_nums_per_device: 8
"""


def write(tmp_path, text: str):
    p = tmp_path / "ms.yaml"
    p.write_text(text)
    return p


def test_a_mindspore_moe_config_loads_with_the_same_values(tmp_path):
    notices: list[str] = []
    cfg = load_config(write(tmp_path, MODEL + MINDSPORE_MOE), notices=notices)
    mc = cfg.model.model_config
    m = mc.moe_config
    assert (m.expert_num, m.num_experts_chosen, m.moe_intermediate_size, m.shared_expert_num) == (8, 2, 32, 1)
    assert (m.routed_scaling_factor, m.norm_topk_prob, m.use_gating_sigmoid, m.topk_method) == (
        2.5,
        True,
        True,
        "noaux_tc",
    )
    assert (m.n_group, m.topk_group, m.z_loss_factor, m.capacity_factor, m.use_gmm) == (4, 2, 0.001, 1.5, True)
    assert (m.balance_via_topk_bias, m.topk_bias_update_rate, m.first_k_dense_replace) == (True, 0.0001, 1)
    assert m.aux_loss_types == ["expert", "device", "comm"] and m.aux_loss_factors == [0.0001, 0.0, 0.0]
    # MindSpore's "expert" loss is the global-batch one here; its device/comm losses at 0 add nothing
    assert aux_losses(mc) == {"global_batch": 0.0001}
    assert [i for i in range(mc.num_layers) if mc.is_moe_layer(i)] == [1, 2, 3]
    assert mc.shared_ffn_size == 32  # shared_expert_num x moe_intermediate_size
    ignored = {"routing_policy", "enable_sdrop", "use_fused_ops_topkrouter", "npu_nums_per_device"}
    assert len(notices) == len(ignored) and all("MindSpore-only" in n for n in notices), notices
    assert {n.split(" ")[0].rsplit(".", 1)[-1] for n in notices} == ignored
    # the same block under the model gives the same config
    nested = MODEL + "    " + MINDSPORE_MOE.replace("\n", "\n    ").rstrip() + "\n"
    assert load_config(write(tmp_path, nested)).model.model_config.moe_config == m


@pytest.mark.parametrize(
    "change, needle",
    [
        ("  n_group: 3\n", "n_group=3 must divide expert_num=8"),
        ("  topk_group: 5\n", "topk_group=5 exceeds n_group=4"),
        ("  num_experts_chosen: 9\n", "num_experts_chosen=9 exceeds expert_num=8"),
        ("  topk_method: aux_loss_free\n", "topk_method"),
        ("  capacity_factor: 0\n", "capacity_factor"),
        ("  capacity_factor: -1.0\n", "capacity_factor"),
        ("  aux_loss_factors: [0.0001, 0.01, 0.0]\n", "'device' is not a balancing loss here"),
        ("  aux_loss_factors: [0.0001]\n", "give one coefficient per loss type"),
        ("  first_k_dense_replace: 4\n", "no layer is sparse"),
        ("  num_experts_chosen: 7\n", "raise topk_group"),
    ],
)
def test_meaningless_moe_configs_are_refused_in_one_line(tmp_path, change, needle):
    key = change.split(":")[0]
    lines = [line for line in MINDSPORE_MOE.splitlines(keepends=True) if not line.startswith(key + ":")]
    with pytest.raises(UserError, match=needle.replace("[", r"\[").replace("(", r"\(")) as e:
        load_config(write(tmp_path, MODEL + "".join(lines) + change))
    assert "\n" not in str(e.value)


def test_moe_on_a_dense_model_type_is_refused(tmp_path):
    with pytest.raises(UserError, match="builds a dense model") as e:
        load_config(write(tmp_path, MODEL.replace("Qwen3MoeConfig", "LlamaConfig") + MINDSPORE_MOE))
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="is a Mixture-of-Experts model"):
        load_config(write(tmp_path, MODEL))  # an MoE type with no experts


@pytest.mark.parametrize(
    "change, needles",
    [
        ("  n_group: 3\n", ("model.model_config.moe_config.n_group=3", "expert_num=8")),
        ("  capacity_factor: 0\n", ("model.model_config.moe_config.capacity_factor",)),
        ("  topk_method: aux_free\n", ("model.model_config.moe_config.topk_method", "noaux_tc")),
    ],
)
def test_config_check_exits_2_with_one_line(tmp_path, capsys, change, needles):
    key = change.split(":")[0]
    lines = [line for line in MINDSPORE_MOE.splitlines(keepends=True) if not line.startswith(key + ":")]
    path = write(tmp_path, MODEL + "".join(lines) + change)
    capsys.readouterr()
    refused(capsys, main(["config", "check", str(path)]), *needles)


def test_config_check_accepts_the_mindspore_block(tmp_path, capsys):
    assert main(["config", "check", str(write(tmp_path, MODEL + MINDSPORE_MOE))]) == 0
    out = capsys.readouterr()
    assert "routing_policy is a MindSpore-only setting" in out.out + out.err
    assert "expert_num: 8" in out.out


DENSE = MODEL.replace("Qwen3MoeConfig", "Qwen3Config")


@pytest.mark.parametrize(
    "text, needles",
    [
        (DENSE + "    kv_lora_rank: 32\n", ("model.model_config.kv_lora_rank=32", "DeepseekV3Config", "Qwen3Config")),
        (DENSE + "    q_lora_rank: 32\n", ("model.model_config.q_lora_rank=32",)),
        (DENSE + "    rope_scaling: {type: yarn, factor: 4.0}\n", ("rope_scaling.type=yarn", "llama3")),
        (
            MODEL.replace("Qwen3MoeConfig", "DeepseekV3Config") + MINDSPORE_MOE,
            ("model.model_config.type=DeepseekV3Config", "kv_lora_rank"),
        ),
    ],
)
def test_latent_attention_fields_outside_the_families_that_build_them_are_refused(tmp_path, capsys, text, needles):
    """A Llama-family model would ignore kv_lora_rank or YaRN silently: one line instead, exit 2."""
    capsys.readouterr()
    refused(capsys, main(["config", "check", str(write(tmp_path, text))]), *needles)
