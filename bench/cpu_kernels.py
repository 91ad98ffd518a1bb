#!/usr/bin/env python
"""The kernels of bench_vs_hf's model timed one by one, to decide which step optimisations pay on this machine.

Prints, for fp32 and bf16 (bf16 only where the CPU has bf16 matmul units):
  1. the model's matmul shapes (forward, input-gradient, weight-gradient, the weight gradient in each operand
     layout, the output projection whole and in chunks) in GFLOP/s against square matmuls, and
     q/k/v and gate/up as three/two matmuls or one fused (a fused projection pays only if it runs faster); in fp32
     also on oneDNN, as `cpu_matmul: onednn` runs them (backends/cpu.py);
  2. attention, forward + backward per layer: SDPA flash, SDPA's math backend, the unfused form (HF "eager":
     `q @ k^T`, fp32 softmax, `@ v`), and compiled: meshformer's causal_attention as a compiled CPU step runs it
     (the blocked kernel under its checkpoint, backends/cpu_attention.py) against its SDPA path (models/attention.py);
  3. the loss over `[batch, seq, vocab]` logits, eager and compiled (meshformer's make_loss_fn);
  4. AdamW over the model's parameter shapes: foreach against fused.
Each figure is the best of several calls after warm-up (a busy machine slows calls, never speeds one up).

    python bench/cpu_kernels.py                 # the bench_vs_hf defaults: hidden 512, ffn 1376, 2048 tokens
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def best_ms(fn, n: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def matmuls(dt, tokens: int, h: int, ffn: int, vocab: int) -> None:
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        line = f"  square {n}: {2 * n**3 / best_ms(lambda: a @ b, 5) / 1e6:.0f} GFLOP/s"
        if dt == torch.float32 and torch.backends.mkldnn.is_available():
            from meshformer.backends.cpu import onednn_mm

            line += f" (oneDNN {2 * n**3 / best_ms(lambda: onednn_mm(a, b), 5) / 1e6:.0f})"
        print(line)
    for k, o in ((h, h), (h, 3 * h), (h, ffn), (h, 2 * ffn), (ffn, h), (h, vocab)):
        x, w, g = torch.randn(tokens, k, dtype=dt), torch.randn(o, k, dtype=dt), torch.randn(tokens, o, dtype=dt)
        flops = 2 * tokens * k * o
        ms = linear_matmuls_ms(x, w, g)
        rates = [flops / ms[f"{kind} torch"] / 1e6 for kind in ("forward", "input grad", "weight grad")]
        print(
            f"  [{tokens}, {k}] x [{k}, {o}]: forward {rates[0]:.0f}, input grad {rates[1]:.0f}, weight grad "
            f"{rates[2]:.0f} GFLOP/s"
        )
        if "forward oneDNN" in ms:  # the same three as cpu_matmul: onednn
            rates = [flops / ms[f"{kind} oneDNN"] / 1e6 for kind in ("forward", "input grad", "weight grad")]
            print(f"    on oneDNN: forward {rates[0]:.0f}, input grad {rates[1]:.0f}, weight grad {rates[2]:.0f}")
        weight_grad_layouts(x, g)
        if o == vocab:
            vocab_chunks(x, w)


def linear_matmuls_ms(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    """A linear's three matmuls, best ms: "forward" `x @ w.t()`, "input grad" `g @ w`, "weight grad" `g.t() @ x`,
    each with " torch" and, in fp32 where oneDNN is built, " oneDNN" (as `cpu_matmul: onednn` runs them)."""
    fns = {
        "forward torch": lambda: x @ w.t(),
        "input grad torch": lambda: g @ w,
        "weight grad torch": lambda: g.t() @ x,
    }
    if x.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from meshformer.backends.cpu import onednn_mm, weight_grad

        fns["forward oneDNN"] = lambda: onednn_mm(x, w)
        fns["input grad oneDNN"] = lambda: onednn_mm(g, w.t())
        fns["weight grad oneDNN"] = lambda: weight_grad(g, x)
    return {name: best_ms(f) for name, f in fns.items()}


def weight_grad_layouts_ms(x: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    """dW = g^T x in the layouts a backward may choose, best ms: both operands transposed (autograd's own), the
    transposed product transposed back, and with either operand copied to row-major first (the copy timed in)."""
    fns = {
        "g^T x": lambda: g.t() @ x,
        "(x^T g)^T": lambda: (x.t() @ g).t().contiguous(),
        "copy g^T": lambda: g.t().contiguous() @ x,
        "copy x^T": lambda: (x.t().contiguous() @ g).t().contiguous(),
    }
    return {name: best_ms(f) for name, f in fns.items()}


def weight_grad_layouts(x: torch.Tensor, g: torch.Tensor) -> None:
    flops = 2 * x.shape[0] * x.shape[1] * g.shape[1]
    ms = weight_grad_layouts_ms(x, g)
    print("    weight grad layouts: " + ", ".join(f"{n} {flops / t / 1e6:.0f}" for n, t in ms.items()))


def vocab_forward_ms(x: torch.Tensor, w: torch.Tensor, chunk: int = 2048) -> dict[str, float]:
    """The output projection's forward whole against split into `chunk`-column pieces (or row pieces of the
    tokens), best ms."""
    rows = max(1, x.shape[0] // 4)
    fns = {
        "whole": lambda: x @ w.t(),
        f"{chunk}-column chunks": lambda: torch.cat([x @ p.t() for p in w.split(chunk)], 1),
        f"{rows}-row chunks": lambda: torch.cat([p @ w.t() for p in x.split(rows)], 0),
    }
    return {name: best_ms(f) for name, f in fns.items()}


def vocab_chunks(x: torch.Tensor, w: torch.Tensor, chunk: int = 2048) -> None:
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    ms = vocab_forward_ms(x, w, chunk)
    print("    output projection forward: " + ", ".join(f"{n} {flops / t / 1e6:.0f}" for n, t in ms.items()))


def attention_ms(dt, batch: int, heads: int, seq: int, head_dim: int) -> dict[str, float]:
    """Causal attention forward + backward of one layer, best ms of each variant."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, heads, seq, head_dim, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(batch, heads, seq, head_dim, dtype=dt)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()

    def flash():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    def math_backend():
        with sdpa_kernel([SDPBackend.MATH]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    def unfused():
        s = (q @ k.transpose(-1, -2)) * head_dim**-0.5
        p = torch.softmax(s.masked_fill(~mask, float("-inf")).float(), -1).to(dt)
        (p @ v).backward(g)

    from meshformer.backends.cpu_attention import checkpointed_attention
    from meshformer.models.attention import sdpa_causal_attention

    def compiled(fn):  # each attention path compiled on its own, as a compiled CPU step runs causal_attention
        compiled_fn = torch.compile(fn, dynamic=False)
        return lambda: compiled_fn(q, k, v).backward(g)

    variants = (
        ("SDPA flash", flash),
        ("SDPA math backend", math_backend),
        ("unfused (HF eager)", unfused),
        ("compiled SDPA flash", compiled(sdpa_causal_attention)),
        ("compiled blocked (meshformer)", compiled(checkpointed_attention)),
    )
    return {name: best_ms(fn, 6) for name, fn in variants}


def attention(dt, batch: int, heads: int, seq: int, head_dim: int) -> None:
    for name, ms in attention_ms(dt, batch, heads, seq, head_dim).items():
        print(f"  {name}: {ms:.1f} ms forward + backward per layer")


def loss_ms(dt, batch: int, seq: int, vocab: int) -> dict[str, tuple[float, float]]:
    """meshformer's loss (make_loss_fn) over `[batch, seq, vocab]` logits, eager and compiled: best ms of its
    forward and of its forward + backward."""
    from meshformer.config import load_config
    from meshformer.train.step import make_loss_fn

    eager = make_loss_fn(load_config(None, []))
    compiled = torch.compile(eager)
    x = torch.randn(batch, seq, vocab, dtype=dt, requires_grad=True)
    y = torch.randint(0, vocab, (batch, seq))
    out = {}
    for name, fn in (("eager", eager), ("compiled", compiled)):
        out[name] = (best_ms(lambda fn=fn: fn(x, y), 6), best_ms(lambda fn=fn: fn(x, y).backward(), 6))
    return out


def loss(dt, batch: int, seq: int, vocab: int) -> None:
    for name, (fwd, both) in loss_ms(dt, batch, seq, vocab).items():
        print(f"  loss {name}: forward {fwd:.1f} ms, forward + backward {both:.1f} ms")


def adamw_ms(shapes: list[tuple[int, ...]]) -> dict[str, float]:
    """One AdamW step over fp32 parameters of these shapes, best ms: "foreach" against "fused"."""
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    out = {}
    for name, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        out[name] = best_ms(opt.step, 8)
    return out


def adamw(h: int, ffn: int, vocab: int, layers: int) -> None:
    shapes = [(vocab, h), (vocab, h), (h,)] + layers * [(h, h)] * 4 + layers * [(ffn, h)] * 3 + layers * [(h,)] * 2
    n = sum(torch.Size(s).numel() for s in shapes)
    for name, ms in adamw_ms(shapes).items():
        print(f"  AdamW {name} over {n / 1e6:.1f}M fp32 parameters: {ms:.1f} ms per step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    from meshformer.backends.cpu import cpu_has_bf16

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dt in (torch.float32, torch.bfloat16):
        if dt == torch.bfloat16 and not cpu_has_bf16():
            print("bf16: skipped (this CPU has no AVX-512 BF16 or AMX: bf16 matmuls would be emulated)")
            continue
        print(f"{dt}:")
        matmuls(dt, a.batch * a.seq, a.hidden, a.ffn, a.vocab)
        attention(dt, a.batch, a.heads, a.seq, a.hidden // a.heads)
        loss(dt, a.batch, a.seq, a.vocab)
    adamw(a.hidden, a.ffn, a.vocab, a.layers)


if __name__ == "__main__":
    main()
