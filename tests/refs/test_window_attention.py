"""Sliding-window attention, attention sinks and the rolling KV cache (models/attention.py, models/llama/model.py; the
blocked kernel: backends/cpu_attention.py):
each against a naive masked softmax written here and against transformers' own code (its sliding-window mask
function, GPT-OSS's eager attention with sinks, a tiny MistralForCausalLM with a window shorter than the text),
forward and backward in fp32; windows with packed documents equal each document alone; the compiled CPU kernel
equals the SDPA path; greedy decoding through the rolling cache equals a full cache, past the window."""

from __future__ import annotations

import pytest
import torch

from meshformer.backends.cpu_attention import blocked_causal_attention
from meshformer.config.model_schema import ModelConfig
from meshformer.models import create_model
from meshformer.models.attention import causal_attention, window_band
from meshformer.models.generate import generate, generate_batch
from meshformer.models.llama import KVCache, document_layout
from meshformer.models.registry import model_config

VOCAB = 100


def naive_attention(q, k, v, window=None, sinks=None, documents=None, scale=None):
    """softmax(q k^T * scale + mask [, sink column]) v in float64, keys and values repeated per query head; a key j
    is seen by query i when j <= i, i - window < j (window given) and both lie in one document (given)."""
    q, k, v = (t.double() for t in (q, k, v))
    b, h, s, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (d**-0.5 if scale is None else scale)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    seen = (j <= i) & (j > i - window) if window is not None else (j <= i)
    seen = seen[None, None]
    if documents is not None:
        seen = seen & (documents[:, None, :, None] == documents[:, None, None, :])
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, h, 1, 1).expand(b, h, s, 1)], -1)
    return (torch.softmax(scores, -1)[..., :s] @ v).float()


def qkv(b=2, heads=4, kv=2, s=13, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g).requires_grad_() for n in (heads, kv, kv)]


def sink_logits(heads=4, seed=1):
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).requires_grad_()


def forward_backward(fn, inputs):
    """fn(*inputs) and the gradients of every input for one fixed random output gradient."""
    out = fn(*inputs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return [out, *torch.autograd.grad(out, inputs, grad_out)]


def assert_same(got, want, tol=1e-5):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------- the window's convention


def test_window_band_is_transformers_sliding_window_mask():
    """i - window < j <= i: transformers 5.x's sliding_window_causal_mask_function, evaluated on the same grid."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    q_idx, kv_idx = torch.arange(11)[:, None], torch.arange(11)[None, :]
    for window in (1, 3, 4, 11, 20):
        theirs = masking_utils.sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx)
        ours = window_band(torch.arange(11), torch.arange(11), window)
        assert torch.equal(ours, theirs), window
        assert int(ours[10].sum()) == min(window, 11)  # the last query sees `window` keys, itself included
    assert torch.equal(window_band(torch.arange(5), torch.arange(5), None), torch.ones(5, 5, dtype=torch.bool).tril())


# ---------------------------------------------------------------- against a naive masked softmax


@pytest.mark.parametrize("window", [None, 1, 4, 13])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_sdpa_path_equals_naive_masked_softmax(window, sinks, kv):
    """causal_attention (eager: SDPA with the banded mask, sinks as an extra key): outputs and the gradients of q, k,
    v and the sinks within 1e-5 of the float64 reference."""
    q, k, v = qkv(kv=kv)
    inputs = [q, k, v] + ([sink_logits()] if sinks else [])
    got = forward_backward(
        lambda q, k, v, *s: causal_attention(q, k, v, window=window, sinks=s[0] if s else None), inputs
    )
    want = forward_backward(lambda q, k, v, *s: naive_attention(q, k, v, window, s[0] if s else None), inputs)
    assert_same(got, want)
    if window == 4:  # the window matters: the plain causal output differs
        assert not torch.allclose(got[0], causal_attention(q, k, v, sinks=inputs[3] if sinks else None), atol=1e-3)


@pytest.mark.parametrize("window", [None, 1, 3, 6, 40])
@pytest.mark.parametrize("block", [2, 4, 5])
def test_blocked_kernel_equals_naive_masked_softmax(window, block):
    """The compiled CPU kernel's blocks (eager here, every block size against windows shorter and longer than a
    block, which skips key blocks left of the window), sinks and GQA: forward and every gradient."""
    q, k, v = qkv(s=17)
    sinks = sink_logits()
    got = forward_backward(
        lambda q, k, v, s: blocked_causal_attention(q, k, v, block, None, None, window, s), [q, k, v, sinks]
    )
    want = forward_backward(lambda q, k, v, s: naive_attention(q, k, v, window, s), [q, k, v, sinks])
    assert_same(got, want)


def test_blocked_kernel_skips_keys_left_of_the_window():
    """Keys left of every query's window are never read: NaN there changes nothing (a masked product would be NaN)."""
    q, k, v = (t.detach() for t in qkv(s=16))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :4], v_bad[:, :, :4] = float("nan"), float("nan")
    got = blocked_causal_attention(q, k_bad, v_bad, 4, window=3)[:, :, 8:]  # queries 8.. see keys 6..
    torch.testing.assert_close(got, blocked_causal_attention(q, k, v, 4, window=3)[:, :, 8:], rtol=0, atol=0)


def test_scale_and_narrow_values_with_window_and_sinks():
    """An explicit scale and values narrower than the queries (latent attention's shapes) take the same paths."""
    q, k, _ = qkv(d=12)
    v = torch.randn(2, 2, 13, 6).requires_grad_()
    sinks = sink_logits()
    want = forward_backward(lambda q, k, v, s: naive_attention(q, k, v, 5, s, scale=0.3), [q, k, v, sinks])
    sdpa_path = forward_backward(lambda q, k, v, s: causal_attention(q, k, v, None, 0.3, 5, s), [q, k, v, sinks])
    blocked = forward_backward(
        lambda q, k, v, s: blocked_causal_attention(q, k, v, 4, None, 0.3, 5, s), [q, k, v, sinks]
    )
    assert_same(sdpa_path, want)
    assert_same(blocked, want)


# ---------------------------------------------------------------- packed documents


@pytest.mark.parametrize("path", ["sdpa", "blocked"])
def test_window_with_packed_documents_equals_each_document_alone(path):
    """A window on packed rows (document_layout's mask): each document's outputs and gradients are those of the
    document run alone, windows and sinks included."""
    lengths = [[5, 9, 6], [12, 8]]
    documents = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    _, mask = document_layout(2, 20, documents, None, "cpu")
    q, k, v = qkv(s=20)
    sinks = sink_logits()

    def attend(q, k, v, mask=None):
        if path == "sdpa":
            return causal_attention(q, k, v, mask, window=4, sinks=sinks)
        return blocked_causal_attention(q, k, v, 3, mask, window=4, sinks=sinks)

    packed = forward_backward(lambda q, k, v: attend(q, k, v, mask), [q, k, v])
    assert_same(packed, forward_backward(lambda q, k, v: naive_attention(q, k, v, 4, sinks, documents), [q, k, v]))
    for row, sizes in enumerate(lengths):
        start = 0
        for n in sizes:
            part = [t[row : row + 1, :, start : start + n].detach().requires_grad_() for t in (q, k, v)]
            out = attend(*part)
            grad_out = torch.randn(packed[0].shape, generator=torch.Generator().manual_seed(7))
            grads = torch.autograd.grad(out, part, grad_out[row : row + 1, :, start : start + n])
            for got, want in zip(packed, [out, *grads]):
                torch.testing.assert_close(got[row : row + 1, :, start : start + n], want, rtol=1e-5, atol=1e-5)
            start += n


# ---------------------------------------------------------------- the compiled kernel


def test_compiled_cpu_kernel_equals_sdpa_path():
    """Compiled on a CPU, causal_attention runs the checkpointed blocked kernel: with a window, packed documents and
    sinks it gives SDPA's outputs and gradients."""
    documents = torch.tensor([[0] * 70 + [1] * 58, [0] * 128])
    _, mask = document_layout(2, 128, documents, None, "cpu")
    q, k, v = qkv(s=128, d=16)
    sinks = sink_logits()
    fn = lambda q, k, v, s: causal_attention(q, k, v, mask, None, 37, s)  # noqa: E731
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = forward_backward(torch.compile(fn, backend=counter, fullgraph=True), [q, k, v, sinks])
    assert counter.frame_count == 1
    assert_same(compiled, forward_backward(fn, [q, k, v, sinks]))


# ---------------------------------------------------------------- transformers' own implementations


def test_sinks_equal_transformers_gpt_oss_eager_attention():
    """GPT-OSS's eager_attention_forward (sinks concatenated to the scores, softmax, the column dropped), with its
    sliding window as the additive mask transformers gives it: the same outputs and gradients (q, k, v, sinks)."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers.masking_utils import sliding_window_causal_mask_function

    q, k, v = qkv(s=11)
    sinks = sink_logits()
    allowed = sliding_window_causal_mask_function(4)(0, 0, torch.arange(11)[:, None], torch.arange(11)[None, :])
    additive = torch.zeros(11, 11).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]

    def theirs(q, k, v, sinks):
        module = torch.nn.Module()
        module.sinks, module.num_key_value_groups, module.training = sinks, 2, False
        out, _ = gpt_oss.eager_attention_forward(module, q, k, v, additive, scaling=8**-0.5)
        return out.transpose(1, 2)  # theirs is [b, s, heads, d]

    want = forward_backward(theirs, [q, k, v, sinks])
    assert_same(
        forward_backward(lambda q, k, v, s: causal_attention(q, k, v, window=4, sinks=s), [q, k, v, sinks]), want
    )
    blocked = forward_backward(
        lambda q, k, v, s: blocked_causal_attention(q, k, v, 4, None, None, 4, s), [q, k, v, sinks]
    )
    assert_same(blocked, want)


def tiny(**kw) -> ModelConfig:
    base = dict(
        hidden_size=64, num_layers=3, num_heads=4, n_kv_heads=2, vocab_size=VOCAB, seq_length=16, intermediate_size=96
    )
    return model_config(**{**base, **kw})


@torch.no_grad()
def windowed_model(windows: list[int | None], seed: int = 1, **kw):
    """A tiny random Llama-shaped model whose layer i has sliding window windows[i] (set on the attention module:
    the test's stand-in for a family's window pattern)."""
    model = create_model(tiny(num_layers=len(windows), **kw), 0)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
    for i, window in enumerate(windows):
        model.layers[str(i)].self_attn.window = window
    return model.eval()


def mistral_pair(window: int):
    """Our model with `window` on every layer and transformers' MistralForCausalLM(sliding_window=window), the same
    weights (our names are Llama's, Mistral's too, without the `model.` prefix)."""
    transformers = pytest.importorskip("transformers")
    ours = windowed_model([window] * 3, theta=10000.0)
    mc = ours.config
    config = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.n_kv_heads,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.theta,
        max_position_embeddings=64,
        sliding_window=window,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    theirs = transformers.MistralForCausalLM(config).eval()
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state, strict=True)
    return ours, theirs


def test_windowed_model_equals_transformers_mistral_with_sliding_window():
    """A text four windows long: logits within 1e-5 of transformers' Mistral with the same window (and clearly not
    those of a global attention)."""
    ours, theirs = mistral_pair(window=4)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(x).logits
        got = ours(x)
        for layer in ours.layers.values():
            layer.self_attn.window = None
        unwindowed = ours(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (unwindowed - want).abs().max() > 1e-2


def test_greedy_generation_past_the_window_equals_transformers_mistral():
    ours, theirs = mistral_pair(window=4)
    prompt = [5, 17, 42, 3, 99, 7]
    with torch.no_grad():
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, pad_token_id=0)
    assert generate(ours, prompt, 14, greedy=True) == want[0, len(prompt) :].tolist()
    for layer in ours.layers.values():  # the window decides these tokens
        layer.self_attn.window = None
    assert generate(ours, prompt, 14, greedy=True) != want[0, len(prompt) :].tolist()


# ---------------------------------------------------------------- the rolling KV cache


def full_cache(model, batch: int, max_len: int) -> KVCache:
    """Every layer's keys kept (no ring): the windows then act through the banded mask alone."""
    mc = model.config
    return KVCache(mc.num_layers, batch, mc.num_kv_heads, max_len, mc.dim_per_head, torch.float32, "cpu")


def greedy_with(model, cache, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    tokens, logits = [], [model(torch.tensor([prompt]), cache)[0, -1]]
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits.append(model(torch.tensor([[tokens[-1]]]), cache)[0, -1])
    return tokens, torch.stack(logits)


@torch.no_grad()
def test_rolling_cache_equals_full_cache_past_the_window():
    """Windows 3 and 5 on two of three layers, 20 tokens decoded after a 7-token prompt (a prefill longer than one
    window): the windowed layers keep 3 and 5 keys, the global one all 27, and the greedy tokens and logits equal
    the full cache's with the banded mask and the uncached forward's."""
    model = windowed_model([3, None, 5])
    prompt = [5, 17, 42, 3, 99, 7, 61]
    ring = model.new_kv_cache(1, 27)
    assert [t.shape[2] for t in ring.k] == [3, 27, 5] and [t.shape[2] for t in ring.v] == [3, 27, 5]
    got, got_logits = greedy_with(model, ring, prompt, 20)
    want, want_logits = greedy_with(model, full_cache(model, 1, 27), prompt, 20)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    uncached = model(torch.tensor([prompt + want]))[0, len(prompt) - 1 :]
    torch.testing.assert_close(got_logits, uncached, rtol=1e-5, atol=1e-5)
    assert generate(model, prompt, 20, greedy=True) == want
    for layer in model.layers.values():  # the windows matter for these tokens
        layer.self_attn.window = None
    assert greedy_with(model, full_cache(model, 1, 27), prompt, 20)[0] != want


@torch.no_grad()
def test_rolling_cache_takes_steps_of_several_tokens():
    """Steps of 1 to 6 tokens after the prefill (longer than the window, past a wrapped ring): the same logits as
    the uncached forward."""
    model = windowed_model([4, None, 2])
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    cache = model.new_kv_cache(2, 24)
    cuts = [0, 5, 6, 12, 14, 15, 21, 24]
    parts = [model(x[:, a:b], cache) for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(parts, 1), model(x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_left_padded_batch_through_the_rolling_cache_equals_each_prompt_alone():
    """Prompts of different lengths (the padding a document of its own, document_layout) decode past the window as
    each alone; sinks on the windowed layers take part."""
    model = windowed_model([3, None, 4])
    with torch.no_grad():
        for i in (0, 2):
            model.layers[str(i)].self_attn.sinks = torch.nn.Parameter(torch.randn(4))
    prompts = [[7], [5, 17, 42, 3, 99], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    alone = [greedy_with(model, full_cache(model, 1, len(p) + 12), p, 12)[0] for p in prompts]
    assert generate_batch(model, prompts, 12, greedy=True) == alone
    for prompt, tokens in zip(prompts, alone):
        x = torch.tensor([prompt + tokens])
        assert model(x)[0, len(prompt) - 1 : -1].argmax(-1).tolist() == tokens  # the uncached forward agrees


# ---------------------------------------------------------------- unchanged without windows or sinks


def test_no_window_no_sinks_leaves_the_attention_and_cache_as_they_were():
    model = windowed_model([None, None, None])
    attn = model.layers["0"].self_attn
    assert attn.window is None and attn.sinks is None and "sinks" not in dict(attn.named_parameters())
    assert attn.attend_options() == {}
    cache = model.new_kv_cache(2, 10)
    assert all(t.shape == (2, 2, 10, 16) for t in cache.k + cache.v)


# ---------------------------------------------------------------- a softmax scale of the family's own


@torch.no_grad()
def test_attention_scale_is_the_queries_scaled_in_training_and_through_the_cache():
    """`Attention.scale` (a family's own q.k scale, e.g. Gemma 3's query_pre_attn_scalar ** -0.5) computes what the
    default scale computes with every q_proj row multiplied by scale * sqrt(head_dim); the cached steps (the rolling
    ring of a windowed layer and a full one) equal the uncached forward, and attend_options hands it on (context
    parallelism's attend takes it)."""
    model, scaled = windowed_model([4, None]), windowed_model([4, None])
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    scale = 0.37
    for layer, other in zip(model.layers.values(), scaled.layers.values()):
        layer.self_attn.scale = scale
        other.self_attn.q_proj.weight.mul_(scale * layer.self_attn.hd**0.5)
    want = scaled(x)
    assert model.layers["0"].self_attn.attend_options() == {"window": 4, "scale": scale}
    assert (windowed_model([4, None])(x) - want).abs().max() > 1e-3  # the scale matters here
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    cache = model.new_kv_cache(2, 20)
    parts = [model(x[:, a:b], cache) for a, b in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(torch.cat(parts, 1), want, rtol=1e-5, atol=1e-5)
