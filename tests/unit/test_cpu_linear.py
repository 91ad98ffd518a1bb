"""fp32 linears on oneDNN (backends/cpu.py) against torch's own F.linear, and the trainer's build with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshformer.backends import cpu
from meshformer.backends.cpu import AUTO_MIN_MACS, OneDNNLinear, onednn_linear, onednn_linear_decision
from meshformer.config import load_config
from meshformer.parallel import init_parallel
from meshformer.train.optim import Optimizers
from meshformer.train.step import build_parts, clip_threshold, train_step

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")

CPU = torch.device("cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# (in, out): a weight under the size where the weight gradient stays with BLAS, out > in, out < in, out == in.
@pytest.mark.parametrize("shape", [(64, 96), (256, 688), (688, 256), (256, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_equal_f_linear(shape, bias):
    """Values and all three gradients equal F.linear's (MKL) up to accumulation order (fp32: rel 1e-6)."""
    n_in, n_out = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, n_in, generator=g, requires_grad=True)
    w = torch.randn(n_out, n_in, generator=g, requires_grad=True)
    b = torch.randn(n_out, generator=g, requires_grad=True) if bias else None
    dy = torch.randn(3, 40, n_out, generator=g)
    ins = [t for t in (x, w, b) if t is not None]
    y = onednn_linear(x, w, b)
    got = torch.autograd.grad(y, ins, dy)
    y_ref = F.linear(x, w, b)
    want = torch.autograd.grad(y_ref, ins, dy)
    assert y.shape == y_ref.shape and rel(y, y_ref) < 1e-6
    for a, e in zip(got, want):
        assert a.shape == e.shape and a.is_contiguous() and rel(a, e) < 1e-6


def test_falls_back_outside_plain_fp32():
    """Autocast and bf16 tensors take F.linear itself: the same dtype and bits as torch's linear."""
    lin = torch.nn.Linear(32, 16)
    lin.__class__ = OneDNNLinear
    x = torch.randn(4, 32)
    with torch.autocast("cpu", torch.bfloat16):
        y = lin(x)
        ref = F.linear(x, lin.weight, lin.bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    xb, wb = x.bfloat16(), lin.weight.detach().bfloat16()
    assert torch.equal(onednn_linear(xb, wb), F.linear(xb, wb))


def test_decision(monkeypatch):
    """auto: oneDNN on AVX-512 CPUs not made by Intel, for fp32 layers only; explicit settings are obeyed."""
    fp32, bf16 = torch.float32, torch.bfloat16
    for vendor, flags, want in [
        ("AuthenticAMD", {"avx2", "avx512f"}, True),
        ("GenuineIntel", {"avx2", "avx512f"}, False),
        ("AuthenticAMD", {"avx2"}, False),
    ]:
        monkeypatch.setattr(cpu, "cpu_vendor_and_flags", lambda v=vendor, f=flags: (v, f))
        on, why = onednn_linear_decision("auto", CPU, fp32)
        assert on is want and why.startswith("cpu_matmul: auto -> " + ("onednn" if want else "blas"))
        assert onednn_linear_decision("auto", CPU, bf16)[0] is False
        assert onednn_linear_decision("onednn", CPU, bf16)[0] is True
        assert onednn_linear_decision("blas", CPU, fp32)[0] is False
    assert onednn_linear_decision("onednn", torch.device("meta"), fp32) == (False, "")
    # A zero-bubble pipeline splits each backward by autograd node: BLAS, whatever the setting.
    assert onednn_linear_decision("onednn", CPU, fp32, split_backward=True)[0] is False


def _build(cpu_matmul: str, extra: dict | None = None):
    o = {
        "model.model_config.hidden_size": 256, "model.model_config.num_layers": 2, "model.model_config.num_heads": 4,
        "model.model_config.n_kv_heads": 2, "model.model_config.intermediate_size": 688,
        "model.model_config.vocab_size": 512, "model.model_config.seq_length": 32,
        "model.model_config.qkv_has_bias": True, "train_dataset.batch_size": 4, "seed": 3, "compile": False,
        "cpu_matmul": cpu_matmul, **(extra or {}),
    }  # fmt: skip
    cfg = load_config(None, [s for k, v in o.items() for s in (f"--{k}", str(v))])
    env = init_parallel(cfg, world_size=1)
    return cfg, env, build_parts(cfg, env)


def _steps(cpu_matmul: str, n: int = 3, extra: dict | None = None) -> tuple[list[float], dict]:
    cfg, env, built = _build(cpu_matmul, extra)
    opt = Optimizers(built.parts.parts, cfg)
    tokens = torch.randint(0, 512, (n, 4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for t in tokens:
        r = train_step(built.parts, opt, env, t[:, :-1], t[:, 1:], n_micro=1, ignore_index=-100,
                       max_grad_norm=clip_threshold(cfg))  # fmt: skip
        losses.append(r.loss)
    return losses, built.parts.parts[0].state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_training_matches_blas_and_repeats_bit_for_bit(tied):
    """The trainer's build with cpu_matmul: onednn swaps every linear and a tied output projection (names
    unchanged), trains to BLAS's losses and weights within fp32 accumulation-order differences, and two runs agree
    bit for bit (resume needs that)."""
    extra = {"model.model_config.tie_word_embeddings": tied}
    _, _, built = _build("onednn", extra)
    model = built.parts.parts[0]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * 2 + (not tied) and all(type(m) is OneDNNLinear for m in linears)
    assert model.tied_head_linear.func is onednn_linear and model.tied_head_linear.keywords == {"min_macs": 0}
    assert built.matmul_note == "cpu_matmul: onednn"
    losses, state = _steps("onednn", extra=extra)
    again, state2 = _steps("onednn", extra=extra)
    ref, ref_state = _steps("blas", extra=extra)
    assert losses == again and all(torch.equal(state[k], state2[k]) for k in state)
    assert state.keys() == ref_state.keys()
    assert all(abs(a - b) / b < 1e-5 for a, b in zip(losses, ref))
    # k_proj.bias is left out: softmax ignores a shift shared by every key, so its true gradient is 0 and what
    # either library computes is rounding noise, which AdamW's first steps scale to a full step of either sign.
    assert max(rel(state[k], ref_state[k]) for k in state if not k.endswith("k_proj.bias")) < 1e-5
    _, _, blas = _build("blas", extra)
    assert not any(type(m) is OneDNNLinear for m in blas.parts.parts[0].modules())
    assert blas.parts.parts[0].tied_head_linear is F.linear


class _CountOneDNN(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.meshformer.onednn_mm.default
        return func(*args, **(kwargs or {}))


def test_selective_recompute_keeps_onednn_outputs():
    """Selective recompute keeps the oneDNN matmuls' outputs as it keeps aten.mm's: backward runs only the gradient
    matmuls, not the forward ones again; full recompute runs those too."""
    counts = {}
    for mode in ("select_recompute", "recompute"):
        cfg, env, built = _build("onednn", {f"recompute_config.{mode}": True})
        part = built.parts.parts[0]
        out = part.layers["0"](torch.randn(4, 32, 256, requires_grad=True), part.rope)
        with _CountOneDNN() as counter:
            out.square().sum().backward()
        counts[mode] = counter.calls
    # 7 linears: each computes dx on oneDNN; dW too for the five with >= 256 x 256 weights (q, o, gate, up, down),
    # k and v (128 x 256 here) keep BLAS for it. Recomputing the forward adds one call per linear.
    assert counts == {"select_recompute": 7 + 5, "recompute": 7 + 5 + 7}


def test_compiled_layer_equals_eager():
    """A compiled layer runs the op as Inductor's opaque kernel: the loss and gradients of eager, to fp32 rounding
    (Inductor fuses the element-wise work between the matmuls in another order)."""
    results = []
    for compiled in (False, True):
        cfg, env, built = _build("onednn", {"compile": compiled})
        part = built.parts.parts[0]
        x = torch.randn(4, 32, 256, generator=torch.Generator().manual_seed(5), requires_grad=True)
        loss = part.layers["0"](x, part.rope).square().sum()
        results.append([loss, *torch.autograd.grad(loss, [x, *part.layers["0"].parameters()])])
    for a, b in zip(*results):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("frozen", [False, True])
def test_saves_what_f_linear_saves(frozen):
    """Backward keeps the tensors F.linear's autograd keeps: with a frozen weight (LoRA's base layers) not the input,
    so activation memory and the planner's figures do not depend on the library."""

    def saved_sizes(fn) -> list[int]:  # F.linear keeps the weight as its transposed view: compare elements
        sizes = []
        x = torch.randn(8, 256, requires_grad=True)
        w = torch.randn(512, 256, requires_grad=not frozen)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn(x, w)
        return sorted(sizes)

    assert saved_sizes(onednn_linear) == saved_sizes(F.linear) == ([512 * 256] if frozen else [8 * 256, 512 * 256])


def test_auto_leaves_small_calls_to_f_linear(monkeypatch):
    """auto: calls under AUTO_MIN_MACS multiply-adds take F.linear itself (bit-equal), where oneDNN's fixed cost per
    call outweighs its kernel; larger ones take oneDNN. An explicit `onednn` takes every call."""
    monkeypatch.setattr(cpu, "cpu_vendor_and_flags", lambda: ("AuthenticAMD", {"avx512f"}))
    _, _, built = _build("auto")
    lin = built.parts.parts[0].layers["0"].mlp.up_proj  # 256 -> 688
    assert type(lin) is OneDNNLinear and lin.onednn_min_macs == AUTO_MIN_MACS
    assert built.matmul_note.startswith("cpu_matmul: auto -> onednn")
    small_rows = AUTO_MIN_MACS // (256 * 688)  # just under the threshold
    for rows, on in ((small_rows, False), (small_rows + 1, True)):
        x = torch.randn(rows, 256)
        with _CountOneDNN() as counter:
            y = lin(x)
        assert counter.calls == on
        if not on:
            assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    lin.onednn_min_macs = 0  # what cpu_matmul: onednn sets
    with _CountOneDNN() as counter:
        lin(torch.randn(1, 256))
    assert counter.calls == 1


@pytest.mark.parametrize("setting", ["onednn", "blas"])
def test_inference_loads_with_the_runs_setting(setting, tmp_path):
    """load_for_inference (generate, eval, convert --verify) applies the checkpoint's cpu_matmul as training does,
    and gives the trained model's logits (fp32: 1e-5)."""
    import yaml
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from meshformer.checkpoint.saver import save_checkpoint
    from meshformer.config import to_dict
    from meshformer.interop.inference import load_for_inference

    cfg, _, built = _build(setting)
    model = built.parts.parts[0]
    extra = {
        "config.yaml": yaml.safe_dump(to_dict(cfg)).encode(),
        "tokenizer.json": Tokenizer(WordLevel({"a": 0}, unk_token="a")).to_str().encode(),
    }
    save_checkpoint(tmp_path / "checkpoint" / "step_00000001", [model], [torch.optim.AdamW(model.parameters())],
                    {"step": 1}, extra)  # fmt: skip
    loaded, _, _ = load_for_inference(tmp_path)
    swapped = [type(m) is OneDNNLinear for m in loaded.modules() if isinstance(m, torch.nn.Linear)]
    assert swapped and all(swapped) == (setting == "onednn") and any(swapped) == (setting == "onednn")
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(loaded(tokens), model.eval()(tokens)) < 1e-5
