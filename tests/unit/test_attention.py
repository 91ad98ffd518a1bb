"""The blocked causal attention (backends/cpu_attention.py) against torch's SDPA: exact gradients (gradcheck in
float64), the same outputs and gradients as SDPA in fp32 and bf16, less kept memory than flash attention, and the
dispatch that runs it only where it was measured faster (compiled, on a CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_overrides
from meshformer.backends.cpu_attention import blocked_causal_attention
from meshformer.models.attention import causal_attention


def _qkv(b, heads, kv, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, kv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, kv, s, d, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize(
    "heads,kv,s,block",
    [(2, 2, 9, 3), (4, 2, 13, 4), (6, 2, 8, 8), (3, 1, 7, 2)],  # MHA, GQA, MQA; blocks that do not divide s
)
def test_gradients_are_exact_in_float64(heads, kv, s, block):
    q, k, v = _qkv(2, heads, kv, s, 5, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: blocked_causal_attention(q, k, v, block), (q, k, v))
    torch.testing.assert_close(blocked_causal_attention(q, k, v, block), _sdpa(q, k, v), rtol=0, atol=1e-12)


def test_packed_documents_mask_is_exact_in_float64():
    """Packed rows (several documents per row, llama.document_layout's causal mask): the same values as SDPA with
    that mask, and exact gradients; GQA, blocks that cut documents."""
    from meshformer.models.llama import document_layout

    documents = torch.tensor([[0] * 5 + [1] * 4 + [2] * 4, [0] * 2 + [1] * 11])
    _, mask = document_layout(2, 13, documents, None, "cpu")
    q, k, v = _qkv(2, 4, 2, 13, 5, torch.float64)
    fn = lambda q, k, v: blocked_causal_attention(q, k, v, 4, mask)  # noqa: E731
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(fn(q, k, v), ref, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert not torch.allclose(ref, _sdpa(q, k, v))  # the mask matters here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", [4, 2])
def test_matches_sdpa_as_closely_as_sdpa_matches_float64(dtype, kv):
    """Against a float64 reference, the kernel's output and gradients are within twice SDPA's own error (flash's
    numerics: fp32 scores and softmax, probabilities rounded to the input dtype before they meet v)."""
    q64, k64, v64 = _qkv(2, 4, kv, 192, 32, torch.float64, seed=1)
    dout = torch.randn(2, 4, 192, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = _sdpa(q64, k64, v64)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout)

    def errors(fn):
        q, k, v = [t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64)]
        out = fn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
        return [(a.double() - b).abs().max().item() for a, b in zip((out, *grads), (ref, *ref_grads))]

    ours, theirs = errors(lambda q, k, v: blocked_causal_attention(q, k, v, 64)), errors(_sdpa)
    floor = 1e-6 if dtype == torch.float32 else 1e-2  # below it both are at the dtype's rounding
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert a <= max(2 * b, floor), (name, a, b)


def _graph_targets(graphs) -> list[str]:
    """Every call target in compiled graphs, checkpointed bodies included."""
    modules = [m for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)]
    return [str(n.target) for m in modules for n in m.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("head_dim", [16, 64])
def test_compiled_on_a_cpu_it_runs_blocked_and_keeps_what_its_rows_allow(head_dim):
    """Compiled (Inductor, as the trainer compiles) on a CPU, causal_attention runs the blocked kernel under a
    checkpoint. Narrow heads (16: the probabilities outweigh q, k and v more than KEEP_PROBABILITIES_UP_TO times)
    keep only q, k and v for backward, less than torch's flash kernel keeps (q, k, v, the output and the
    log-sum-exp): no [seq, seq] scores survive the forward. Wider ones (64) keep q, k, v and exactly the causal
    blocks' fp32 probabilities, nothing else (no slice copies, no scores). Eager, it is SDPA. All give the same
    values."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from meshformer.backends.cpu_attention import keeps_probabilities

    def run(fn):
        q, k, v = _qkv(2, 4, 2, 256, head_dim, torch.float32)
        sizes = []

        def pack(t):
            sizes.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(q, k, v)
        return out, torch.autograd.grad(out.square().sum(), (q, k, v)), sum(sizes)

    eager, eager_grads, flash_bytes = run(causal_attention)
    assert eager.grad_fn.name().startswith("ScaledDotProductFlashAttention")
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled, grads, kept = run(torch.compile(causal_attention, backend=counter, fullgraph=True))
    targets = _graph_targets(counter.graphs)
    assert any("softmax" in t for t in targets) and not any("scaled_dot_product" in t for t in targets), targets
    q_bytes = 2 * 4 * 256 * head_dim * 4
    qkv_bytes = q_bytes + 2 * (q_bytes // 2)  # q (4 heads), k and v (2)
    keeps = keeps_probabilities(*_qkv(2, 4, 2, 256, head_dim, torch.float32))
    assert keeps == (head_dim == 64)
    # 64-row blocks: block i scores 64 queries against 64 * (i + 1) keys, per batch row and head, in fp32
    probabilities = 2 * 4 * 64 * 64 * (1 + 2 + 3 + 4) * 4
    assert kept == qkv_bytes + (probabilities if keeps else 0), (kept, qkv_bytes, probabilities)
    if not keeps:
        assert kept < flash_bytes, (kept, flash_bytes)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads):  # fp32 sums in another order: within its rounding of the largest gradient
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_compiled_training_with_selective_recompute_matches_eager(tiny_dataset, tmp_path, monkeypatch):
    """Compiled on a CPU the decoder layers run the blocked kernel (GQA here: 4 heads on 2 kv heads, seq 80 in two
    blocks) under its checkpoint, nested in selective recompute's: training reaches the eager (SDPA) run's losses.
    (No recompute and full recompute, compiled, are in the parallel parity suite: fsdp2:compiled,
    dp2_rc_accum:compiled.)"""
    import json

    from torch._dynamo.testing import CompileCounterWithBackend

    from meshformer.config import load_config
    from meshformer.train.trainer import run_training

    def losses(name, extra):
        out = tmp_path / name
        base = {"model.model_config.seq_length": 80, "runner_config.stop_step": 3, "train_dataset.batch_size": 2}
        run_training(load_config(None, tiny_overrides(tiny_dataset, out, {**base, **extra})))
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in recs if "loss" in r]

    eager = losses("eager", {"compile": False})
    real_compile = torch.compile
    for i, rc in enumerate(({"recompute_config.select_recompute": True},)):
        torch._dynamo.reset()  # a graph cached by the previous run would be reused without tracing the kernel
        counter = CompileCounterWithBackend("inductor")  # Inductor, as the trainer compiles, recording the graphs
        monkeypatch.setattr(torch, "compile", lambda fn=None, c=counter, **kw: real_compile(fn, **{**kw, "backend": c}))
        compiled = losses(f"compiled_{i}", {"compile": True, **rc})
        targets = _graph_targets(counter.graphs)  # layers and loss compiled, the layers through the blocked kernel
        assert counter.frame_count >= 2 and any("softmax" in t for t in targets), rc
        assert not any("scaled_dot_product" in t for t in targets), rc
        assert len(compiled) == 3, compiled
        for e, c in zip(eager, compiled):
            assert abs(c - e) < 1e-4 * e, (rc, eager, compiled)


def test_the_selective_checkpoint_notice_is_dropped_and_nothing_else():
    """torch.compile logs a notice (once a process) on meeting a selective checkpoint; meshformer's regions run no
    in-place op, so importing the modules that use one drops exactly that record from torch's logger."""
    import logging

    import meshformer.backends.cpu_attention  # noqa: F401 - installs the filter
    from meshformer.backends.torch_private import SELECTIVE_CHECKPOINT_NOTICE

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    logger.addHandler(handler)
    try:
        logger.warning("\nDetected that %s.\nPlease make sure ...", SELECTIVE_CHECKPOINT_NOTICE)
        logger.warning("another warning")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["another warning"]


def test_recomputed_layers_attend_without_keeping_probabilities():
    """Recompute (full or selective) gives a wrapped layer's attention `recomputed_causal_attention`, whose compiled
    CPU kernel keeps nothing the layer's own checkpoint would not: the selective policy's must-save would win over
    the enclosing recompute and keep every layer's probabilities. Layers left alone keep `causal_attention`."""
    from meshformer.config import load_config
    from meshformer.models.attention import recomputed_causal_attention
    from meshformer.parallel import init_parallel
    from meshformer.train.step import build_parts

    o = {
        "model.model_config.hidden_size": 64, "model.model_config.num_layers": 3, "model.model_config.num_heads": 4,
        "model.model_config.n_kv_heads": 2, "model.model_config.intermediate_size": 96,
        "model.model_config.vocab_size": 128, "model.model_config.seq_length": 16, "compile": False,
        "recompute_config.recompute": "[1]", "recompute_config.select_recompute": "[2]",
    }  # fmt: skip
    cfg = load_config(None, [s for k, v in o.items() for s in (f"--{k}", str(v))])
    model = build_parts(cfg, init_parallel(cfg, world_size=1)).parts.parts[0]
    attends = [[m.attend for m in layer.modules() if hasattr(m, "attend")] for layer in model.layers.values()]
    assert attends == [[recomputed_causal_attention], [recomputed_causal_attention], [causal_attention]]
