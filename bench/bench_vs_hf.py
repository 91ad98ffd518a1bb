#!/usr/bin/env python
"""Training throughput of meshformer against Hugging Face transformers' LlamaForCausalLM, in one process.

Both sides train the same Llama config from the same initial weights (meshformer's, copied into the HF model
and checked by comparing logits), on the same random token batches, with the same AdamW hyper-parameters,
gradient clipping and dtype policy (fp32, or bf16 autocast over fp32 master weights):

  meshformer: the trainer's real path: `load_config(None, overrides)` -> `build_model` -> `parallelize`
              -> `materialize` -> `build_optimizer`; each step `ModelParts.forward_backward` (with
              `make_loss_fn`), `ModelParts.clip_grad_norm_`, `optimizer.step()`, `zero_grad(set_to_none=True)`.
  transformers: the idiomatic loop: `model(input_ids, labels=..., shift_labels=...).loss`, `backward()`,
              `torch.nn.utils.clip_grad_norm_`, `optimizer.step()`, `zero_grad(set_to_none=True)`.

HF shifts `labels` inside the model; passing the already-shifted labels as `shift_labels` makes both sides
score the same 256 next-token predictions per sample (tokens[:, 1:] given tokens[:, :-1]), so their losses
are the same number and can be compared step by step (a fairness check: same work, same numerics).

The two sides alternate in rounds (meshformer k steps, HF k steps, ...) so that load from other processes on
a shared machine hits both alike. Warm-up steps are excluded; tokens/s is reported as the median over the
timed steps and as total tokens / total time.

    python bench/bench_vs_hf.py                      # fp32, ~34M parameters, batch 8 x 256
    python bench/bench_vs_hf.py --dtype bf16         # bf16 autocast, fp32 master weights
    python bench/bench_vs_hf.py --profile 2          # + torch.profiler op table of 2 steps per side
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side (after warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    p.add_argument("--round", type=int, default=2, help="steps one side runs before the other takes over")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hf-foreach",
        choices=("default", "true", "false"),
        default="default",
        help="HF side's torch.optim.AdamW foreach= (default: torch's own choice, for-loop on CPU)",
    )
    p.add_argument(
        "--mf-foreach",
        choices=("config", "true", "false"),
        default="config",
        help="meshformer's optimizer.foreach (config: the schema default)",
    )
    p.add_argument(
        "--mf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra meshformer config override, repeatable (e.g. compile=true, optimizer.fused=true)",
    )
    p.add_argument(
        "--run-steps",
        type=int,
        default=1000,
        help="length of the training run these steps stand for: compile: auto judges from it whether compiling pays "
        "(the trainer passes its own run length)",
    )
    p.add_argument("--show-steps", type=int, default=5, help="print per-step losses of this many first steps")
    p.add_argument("--peak-flops", type=float, default=0.0, help="peak FLOP/s for MFU (0: time a matmul)")
    p.add_argument("--profile", type=int, default=0, help="after timing, profile this many steps per side")
    p.add_argument("--only", choices=("both", "meshformer", "hf"), default="both")
    p.add_argument(
        "--hf-host-memory",
        choices=("default", "retained"),
        default="default",
        help="HF side's malloc: glibc's settled defaults (as a process of its own runs), or meshformer's retained "
        "host memory (backends/cpu.py)",
    )
    return p.parse_args(argv)


# ---- meshformer ----------------------------------------------------------------------------------------------
def model_overrides(a) -> dict:
    """The model these flags describe (untied, fp32 master weights, compute in --dtype) as config overrides."""
    return {
        "model.model_config.hidden_size": a.hidden,
        "model.model_config.num_layers": a.layers,
        "model.model_config.num_heads": a.heads,
        "model.model_config.n_kv_heads": a.kv_heads,
        "model.model_config.intermediate_size": a.ffn,
        "model.model_config.vocab_size": a.vocab,
        "model.model_config.seq_length": a.seq,
        "model.model_config.tie_word_embeddings": False,
        "model.model_config.compute_dtype": "bfloat16" if a.dtype == "bf16" else "float32",
        "model.model_config.param_init_type": "float32",
        "train_dataset.batch_size": a.batch,
    }


def build_meshformer(a):
    from meshformer.config import load_config
    from meshformer.parallel import init_parallel
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import build_parts

    o = {
        **model_overrides(a),
        "seed": a.seed,
        "optimizer.learning_rate": a.lr,
        "optimizer.weight_decay": a.weight_decay,
        "lr_schedule.type": "constant",
        "runner_wrapper.use_clip_grad": True,
        "runner_wrapper.max_grad_norm": a.max_grad_norm,
    }
    if a.mf_foreach != "config":
        o["optimizer.foreach"] = a.mf_foreach == "true"
    for item in a.mf:
        key, _, value = item.partition("=")
        o[key] = value
    overrides = [s for k, v in o.items() for s in (f"--{k}", str(v))]
    cfg = load_config(None, overrides)
    env = init_parallel(cfg, world_size=1)
    # The trainer's build (model, transforms, parallelize, materialize), told the run's length as the trainer tells it.
    built = build_parts(cfg, env, run_tokens=a.run_steps * a.batch * a.seq)
    print(built.parts.compile_note + f" [a run of {a.run_steps} steps: --run-steps]")
    if built.matmul_note:
        print(built.matmul_note)
    n_params = sum(p.numel() for p in built.model.parameters())
    n_embedding = built.model.embed_tokens.weight.numel()
    parts = built.parts
    optimizer = Optimizers(parts.parts, cfg)
    parts.train()
    return cfg, env, parts, optimizer, n_params, n_embedding


def meshformer_step(cfg, env, parts, optimizer, tokens):
    """One optimizer step: the trainer's own train_step (n_micro = 1, one process)."""
    from meshformer.train.step import clip_threshold, train_step

    result = train_step(
        parts,
        optimizer,
        env,
        tokens[:, :-1],
        tokens[:, 1:],
        n_micro=1,
        ignore_index=cfg.model.model_config.ignore_token_id,
        max_grad_norm=clip_threshold(cfg),
    )
    return result.loss


# ---- transformers --------------------------------------------------------------------------------------------
def build_hf(a, cfg, mf_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = cfg.model.model_config
    hc = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.theta,
        max_position_embeddings=a.seq,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    hc._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(hc).to(torch.float32)
    # Our parameter names are HF's without the "model." prefix (lm_head keeps its name).
    from meshformer.models.init import canonical_name

    named = {canonical_name(k): v for k, v in mf_model.state_dict().items()}  # compile adds `_orig_mod.`
    sd = {(k if k.startswith("lm_head.") else "model." + k): v for k, v in named.items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        sys.exit(f"weight copy into HF failed: missing {missing}, unexpected {unexpected}")
    hf.train()
    oc = cfg.optimizer
    decay = [p for p in hf.parameters() if p.ndim >= 2]  # same rule as meshformer: no decay on norms/biases
    no_decay = [p for p in hf.parameters() if p.ndim < 2]
    kw = {} if a.hf_foreach == "default" else {"foreach": a.hf_foreach == "true"}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": oc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(oc.beta1, oc.beta2),
        eps=oc.eps,
        **kw,
    )
    return hf, opt


def hf_step(hf, opt, tokens, autocast_dtype, max_grad_norm):
    inputs, labels = tokens[:, :-1], tokens[:, 1:].contiguous()  # HF's loss .view()s the labels
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = hf(input_ids=inputs, labels=labels, shift_labels=labels)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.item()


# ---- driver --------------------------------------------------------------------------------------------------
def batches(a, n):
    g = torch.Generator().manual_seed(1234 + a.seed)
    return [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g) for _ in range(n)]


def check_logits(parts, hf, a, autocast_dtype) -> float:
    x = torch.randint(0, a.vocab, (2, a.seq), generator=torch.Generator().manual_seed(99))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_dtype is not None):
        ours = parts.parts[0](x).float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_dtype is not None):
        theirs = hf(input_ids=x).logits.float()
    return (ours - theirs).abs().max().item()


def measure_peak(dtype) -> tuple[float, str]:
    from meshformer.backends.cpu import cpu_has_bf16
    from meshformer.backends.peaks import measure_matmul_peak

    cpu = torch.device("cpu")
    if dtype != torch.float32 and not cpu_has_bf16():  # bf16 matmuls are fp32 work here (backends/peaks.py)
        peak, src = measure_peak(torch.float32)
        return peak, src + "; this CPU has no bf16 matmul units"
    # best of three: the machine is shared, a slow sample is someone else's load
    best = max((measure_matmul_peak(cpu, dtype) for _ in range(3)), key=lambda m: m.flops)
    return best.flops, f"measured: best of 3 calls, each the best of {len(best.rates)} matmuls; {best.best}"


def profile_steps(name, fn, n):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    print(f"\n==== torch.profiler: {name}, {n} steps (self CPU time) ====")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    import transformers

    from meshformer.backends.cpu import GLIBC_SETTLED, RETAINED, set_malloc
    from meshformer.models.registry import family_of

    cfg, env, parts, mf_opt, n_params, n_emb = build_meshformer(a)
    mc = cfg.model.model_config
    autocast_dtype = torch.bfloat16 if a.dtype == "bf16" else None
    hf, hf_opt = build_hf(a, cfg, parts.parts[0])
    n_hf = sum(p.numel() for p in hf.parameters())

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
        f"dtype {a.dtype}" + (" (autocast bf16, fp32 master weights)" if autocast_dtype else "")
    )
    if cfg.retain_host_memory:  # build_parts tuned this process's malloc (backends/cpu.py)
        print(
            "host memory: meshformer's rounds retain it (retain_host_memory); HF's rounds run with "
            + ("it too (--hf-host-memory retained)" if a.hf_host_memory == "retained" else "glibc's settled defaults")
        )
    print(
        f"model: hidden {a.hidden}, {a.layers} layers, {a.heads} heads / {a.kv_heads} kv, ffn {a.ffn}, vocab "
        f"{a.vocab}, seq {a.seq}, batch {a.batch}: {n_params / 1e6:.2f}M parameters (HF {n_hf / 1e6:.2f}M)"
    )
    from torch.optim.optimizer import _default_to_fused_or_foreach

    hf_impl = hf_opt.defaults.get("foreach")
    if hf_impl is None:
        hf_impl = f"None -> {_default_to_fused_or_foreach(list(hf.parameters()), False, False)[1]}"
    print(
        f"AdamW lr {a.lr}, betas ({cfg.optimizer.beta1}, {cfg.optimizer.beta2}), eps {cfg.optimizer.eps}, "
        f"weight decay {cfg.optimizer.weight_decay} (not on 1-D), clip {a.max_grad_norm}; meshformer "
        f"{'fused' if mf_opt.items[0].defaults.get('fused') else 'foreach=' + str(cfg.optimizer.foreach)}, "
        f"HF foreach={hf_impl}"
    )
    diff32 = check_logits(parts, hf, a, None)
    line = f"initial logits max |meshformer - HF|: fp32 {diff32:.2e}"
    if autocast_dtype is not None:
        line += f", bf16 autocast {check_logits(parts, hf, a, autocast_dtype):.2e}"
    print(line)
    if diff32 > 1e-4:
        print("WARNING: fp32 logits differ by more than 1e-4: the comparison is not like for like")

    total = a.warmup + a.steps
    data = batches(a, total)
    tok_per_step = a.batch * a.seq
    sides = {
        "meshformer": lambda t: meshformer_step(cfg, env, parts, mf_opt, t),
        "HF": lambda t: hf_step(hf, hf_opt, t, autocast_dtype, a.max_grad_norm),
    }
    # malloc settings per side (backends/cpu.py): each side runs as its users' processes do.
    malloc = {"meshformer": RETAINED if cfg.retain_host_memory else GLIBC_SETTLED, "HF": GLIBC_SETTLED}
    if a.hf_host_memory == "retained":
        malloc["HF"] = malloc["meshformer"]
    if a.only == "meshformer":
        sides.pop("HF")
    elif a.only == "hf":
        sides.pop("meshformer")
    losses = {k: [] for k in sides}
    times = {k: [] for k in sides}
    step = 0
    while step < total:
        chunk = range(step, min(total, step + a.round))
        for name, fn in sides.items():
            set_malloc(malloc[name])
            for i in chunk:
                t0 = time.perf_counter()
                losses[name].append(fn(data[i]))
                dt = time.perf_counter() - t0
                if i >= a.warmup:
                    times[name].append(dt)
        step = chunk.stop

    if len(sides) == 2:
        print(f"\nper-step loss (same batches; steps 1..{min(a.show_steps, total)}):")
        print(f"  {'step':>4}  {'meshformer':>12}  {'HF':>12}  {'|diff|':>9}")
        for i in range(min(a.show_steps, total)):
            m, h = losses["meshformer"][i], losses["HF"][i]
            print(f"  {i + 1:>4}  {m:>12.8f}  {h:>12.8f}  {abs(m - h):>9.2e}")
        worst = max(abs(m - h) for m, h in zip(losses["meshformer"], losses["HF"]))
        print(f"  max |diff| over all {total} steps: {worst:.2e}")

    peak, src = (a.peak_flops, "--peak-flops") if a.peak_flops > 0 else measure_peak(autocast_dtype or torch.float32)
    fpt = family_of(mc).flops_per_token(mc)
    print(
        f"\nthroughput ({a.steps} timed steps per side after {a.warmup} warm-up, alternating in rounds of "
        f"{a.round}; {fpt / 1e6:.1f} MFLOP/token; peak {peak / 1e12:.3f} TFLOP/s, {src}):"
    )
    med = {}
    for name in sides:
        ts = times[name]
        med[name] = tok_per_step / statistics.median(ts)
        mean = tok_per_step * len(ts) / sum(ts)
        print(
            f"  {name:>10}: {med[name]:8.0f} tok/s median ({mean:.0f} mean; step {statistics.median(ts):.3f} s "
            f"median, min {min(ts):.3f}, max {max(ts):.3f}), MFU {fpt * med[name] / peak:.1%}"
        )
    if len(sides) == 2:
        print(f"  ratio meshformer / HF: {med['meshformer'] / med['HF']:.3f}x (medians)")

    if a.profile:
        it = iter(range(10**9))
        for name, fn in sides.items():
            set_malloc(malloc[name])
            profile_steps(name, lambda fn=fn: fn(data[next(it) % total]), a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
