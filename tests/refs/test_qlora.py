"""QLoRA (LoRA over an NF4 base, models/qlora.py) against its references: the NF4 weights against bitsandbytes' own
NF4 quantization of the same weights, the model's logits and adapter gradients against `peft` over `transformers`
holding our dequantized base, and the quantization error of the whole model against bitsandbytes' 4-bit model's.
(Parallel layouts: the `qlora` variant of the parity suite, tests/parity/test_parallel.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from meshformer.checkpoint.store import load_full_weights
from meshformer.config import load_config
from meshformer.interop.hf_dir import to_meshformer_names
from meshformer.models.init import build_model, materialize
from meshformer.models.lora import base_name, peft_adapter
from meshformer.models.qlora import NF4Linear, dequantized_state_dict
from meshformer.models.registry import family_of
from meshformer.models.transforms import apply_model_transforms

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPE = {  # a transformers Llama and the same model in meshformer's fields; kv heads 2: k/v are 32 x 64
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
M = "model.model_config."
OURS = {
    M + "hidden_size": 64, M + "intermediate_size": 128, M + "num_layers": 2, M + "num_heads": 4,
    M + "n_kv_heads": 2, M + "vocab_size": 512, M + "seq_length": 64, M + "rms_norm_eps": 1e-5,
    M + "pet_method": "qlora", M + "pet_config.lora_rank": 4, M + "pet_config.lora_alpha": 8,
    M + "pet_config.target_modules": str(TARGETS).replace("'", ""),
}  # fmt: skip


def bnb_nf4(w: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' NF4 round trip: blocks of 64, double-quantized scales (its `compress_statistics`)."""
    q, state = bnb_functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    return bnb_functional.dequantize_4bit(q, state)


def ours_nf4(w: torch.Tensor) -> torch.Tensor:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return NF4Linear(lin).dequantized()


@pytest.mark.parametrize("shape", [(256, 512), (192, 576)])  # 576 x 192: SmolLM2's k_proj, 216 scales per block
def test_nf4_weights_are_within_bitsandbytes_own_error(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 5] = 0.3  # an outlier: its block's scale is large, the rest of the block coarse
    ours, theirs = ours_nf4(w), bnb_nf4(w)
    err, bnb_err = (ours - w).abs(), (theirs - w).abs()
    # The same format, not the same codes: torchao rounds to the nearest of the 16 levels, bitsandbytes compares
    # with its midpoints in its own arithmetic, and the two double-quantize the scales apart. Measured: the mean
    # errors agree within 0.1%, the largest within 2%, and about 93% of the weights get the same value.
    assert err.mean() <= 1.01 * bnb_err.mean()
    assert err.max() <= 1.05 * bnb_err.max()
    assert ((ours - theirs).abs() <= 1e-3 * w.abs().max()).float().mean() >= 0.9


def _hf_llama() -> nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _qlora_from(hf: nn.Module, cfg) -> nn.Module:
    """Our QLoRA model holding hf's weights (its base linears quantized as a run's load does), with adapters B
    non-zero so they count."""
    model = build_model(cfg.model.model_config)
    apply_model_transforms(model, cfg)
    materialize(model, "cpu", 0, torch.float32)
    family = family_of(cfg.model.model_config)
    theirs = to_meshformer_names(hf.state_dict(), tied=False, family=family)
    load_full_weights([model], {k: theirs[base_name(k)] for k in model.state_dict() if base_name(k) is not None})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return model


def _peft_over(hf: nn.Module, ours: nn.Module, cfg) -> nn.Module:
    """peft's LoRA over `hf` whose base linears hold our dequantized NF4 weights, with our adapters."""
    mc = cfg.model.model_config
    family = family_of(mc)
    state = dequantized_state_dict(ours)
    base = {base_name(k): v for k, v in state.items() if base_name(k) is not None}
    hf.load_state_dict(family.to_hf_state(base, mc))
    config, tensors = peft_adapter(ours, cfg, None)
    lora = peft.LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], target_modules=config["target_modules"])
    wrapped = peft.get_peft_model(hf, lora)
    missing = peft.set_peft_model_state_dict(wrapped, {k: v.clone() for k, v in tensors.items()})
    assert not missing.unexpected_keys
    return wrapped


def test_qlora_logits_and_adapter_grads_equal_peft_over_the_dequantized_base():
    cfg = load_config(None, [f"--{k}={v}" for k, v in OURS.items()])
    ours = _qlora_from(_hf_llama(), cfg)
    assert sum(isinstance(m, NF4Linear) for m in ours.modules()) == 14
    theirs = _peft_over(_hf_llama(), ours, cfg)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    got, want = ours(x), theirs(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    labels = torch.roll(x, -1, 1)
    nn.functional.cross_entropy(got.flatten(0, 1), labels.flatten()).backward()
    nn.functional.cross_entropy(want.flatten(0, 1), labels.flatten()).backward()
    ours_grads = {k: p.grad for k, p in ours.named_parameters() if p.requires_grad}
    theirs_grads = {k: p.grad for k, p in theirs.named_parameters() if p.requires_grad}
    assert len(ours_grads) == len(theirs_grads) == 28
    for key, grad in ours_grads.items():  # layers.0.self_attn.q_proj.lora_A.weight -> peft's key
        hf_key = next(k for k in theirs_grads if k.endswith(key.replace(".weight", ".default.weight")))
        torch.testing.assert_close(grad, theirs_grads[hf_key], rtol=1e-5, atol=1e-6)


def test_qlora_logit_error_is_within_bitsandbytes_4bit_models():
    """Against the unquantized model: our NF4 base's logit error is within 10% of a model whose base linears
    hold bitsandbytes' NF4 round trip of the same weights (what its 4-bit model computes with)."""
    cfg = load_config(None, [f"--{k}={v}" for k, v in {**OURS, M + "pet_config.lora_rank": 1}.items()])
    hf = _hf_llama()
    ours = _qlora_from(hf, cfg)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("lora_B.weight"):
                p.zero_()  # adapters as training starts them: the base alone
    bnb = _hf_llama()
    with torch.no_grad():
        for name, m in bnb.named_modules():
            if name.rpartition(".")[2] in TARGETS:
                m.weight.copy_(bnb_nf4(m.weight))
    x = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        exact = hf(input_ids=x).logits
        ours_err = (ours(x) - exact).abs().mean()
        bnb_err = (bnb(input_ids=x).logits - exact).abs().mean()
    assert bnb_err > 1e-3  # quantization moves the logits measurably
    assert ours_err <= 1.1 * bnb_err


def test_a_bitsandbytes_4bit_directory_imports_as_bitsandbytes_dequantizes_it(tmp_path):
    from meshformer.interop.hf_dir import read_hf_dir

    _hf_llama().save_pretrained(tmp_path / "full")
    for double in (True, False):
        quant = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double
        )
        q = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "full", quantization_config=quant, device_map="cpu"
        )
        q.save_pretrained(tmp_path / f"bnb{double}")
        got = read_hf_dir(tmp_path / f"bnb{double}").tensors
        assert len(got) == len(_hf_llama().state_dict())  # every tensor once, no quantization state left
        linears = {n: m for n, m in q.named_modules() if hasattr(getattr(m, "weight", None), "quant_state")}
        assert len(linears) == 14
        for name, m in linears.items():
            want = bnb_functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
            torch.testing.assert_close(got[f"{name}.weight"], want, rtol=0, atol=0)


def test_a_bitsandbytes_8bit_directory_is_refused(tmp_path, capsys):
    from meshformer.cli.main import main

    _hf_llama().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import", str(tmp_path / "hf"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "8-bit" in err and "load_in_4bit" in err, err


def test_the_nf4_base_holds_under_0_6_bytes_a_weight_and_the_planner_counts_it_exactly():
    from meshformer.models.qlora import is_nf4
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.memory import plan_memory
    from meshformer.train.metrics import tensor_bytes

    cfg = load_config(None, [f"--{k}={v}" for k, v in OURS.items()])
    model = _qlora_from(_hf_llama(), cfg)
    base = [p for p in model.parameters() if is_nf4(p)]
    per_weight = tensor_bytes(base) / sum(p.numel() for p in base)
    # 4-bit codes (0.5), an int8 scale per 64 weights (1/64), an fp32 factor per scaler block, the mean and the
    # 16-entry table per weight: 0.53 on these small layers, 0.516 on a 4096 x 4096 one
    assert 0.5 < per_weight <= 0.6
    (stage,) = plan_memory(cfg, ParallelDims.from_config(cfg, 1), 1, 1)
    assert stage.params_bytes == tensor_bytes(model.parameters())
