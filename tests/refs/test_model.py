"""The model against independent references: textbook formulas and Hugging Face `transformers`.

Every parity test randomises *all* weights (norm scales and biases included, which init to 1 and 0),
so a mis-wired norm or bias cannot hide behind its default value.
"""

from __future__ import annotations

import cmath
import copy

import pytest
import torch

from meshformer.config.model_schema import ModelConfig, RopeScalingConfig
from meshformer.models import build_model, create_model, materialize, num_params
from meshformer.models.llama import RMSNorm, apply_rotary, rope_cos_sin, rope_inv_freq
from meshformer.models.registry import model_config

VOCAB = 100


def tiny(**kw) -> ModelConfig:
    base = dict(
        hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, vocab_size=VOCAB, seq_length=16, intermediate_size=96
    )
    base.update(kw)
    return model_config(**base)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(p + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def tokens(b: int = 2, s: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- shapes


def test_shapes_and_pipeline_stage_shapes():
    mc = tiny()
    m = create_model(mc, 0)
    assert m(tokens()).shape == (2, 16, VOCAB)
    # A middle pipeline stage (no embedding, no final norm, no head) maps hidden states to hidden states.
    mid = create_model(mc, 0)
    mid.embed_tokens, mid.norm, mid.lm_head = None, None, None
    h = torch.randn(2, 16, 64)
    assert mid(h).shape == (2, 16, 64)
    # Parameter count by formula: embed + head + per layer (q, k, v, o, 3 MLP mats, 2 norms) + final norm.
    hd, kv, ffn = 16, 2, 96
    per_layer = 64 * 4 * hd + 2 * 64 * kv * hd + 4 * hd * 64 + 3 * 64 * ffn + 2 * 64
    assert num_params(m) == 2 * VOCAB * 64 + 2 * per_layer + 64
    assert num_params(m, exclude_embedding=True) == num_params(m) - VOCAB * 64


# ---------------------------------------------------------------- rotary


def test_rotary_matches_complex_pair_rotation():
    d, theta, seq = 16, 10000.0, 12
    mc = tiny(hidden_size=64, num_heads=4, theta=theta, seq_length=seq)
    cos, sin = rope_cos_sin(mc, torch.arange(seq), torch.float64)
    x = torch.randn(2, 3, seq, d, dtype=torch.float64)
    got = apply_rotary(x, cos, sin)
    # Reference: pair (x[j], x[j + d/2]) is the complex number x[j] + i x[j + d/2], rotated by m * theta_j.
    want = torch.empty_like(x)
    for m in range(seq):
        for j in range(d // 2):
            ang = m * theta ** (-2 * j / d)
            z = torch.complex(x[..., m, j], x[..., m, j + d // 2]) * cmath.exp(1j * ang)
            want[..., m, j], want[..., m, j + d // 2] = z.real, z.imag
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # The property rotary exists for: q(m) . k(n) depends only on m - n.
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)

    def dot(m, n):
        return (apply_rotary(q, cos[m], sin[m]) * apply_rotary(k, cos[n], sin[n])).sum()

    torch.testing.assert_close(dot(7, 3), dot(5, 1))
    assert not torch.allclose(dot(7, 3), dot(7, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_rotate_half_bit_for_bit(dtype):
    """apply_rotary's swapped-halves form gives the textbook rotate-half values and gradients exactly."""
    mc = tiny(hidden_size=64, num_heads=4, seq_length=12)
    cos, sin = rope_cos_sin(mc, torch.arange(12), torch.float32)
    x = torch.randn(2, 3, 12, 16, dtype=dtype, requires_grad=True)
    g = torch.randn(2, 3, 12, 16, dtype=dtype)

    def rotate_half(t):  # the former implementation
        tc = t.to(torch.float32)
        t1, t2 = tc.chunk(2, dim=-1)
        return (tc * cos + torch.cat([-t2, t1], dim=-1) * sin).to(t.dtype)

    got = apply_rotary(x, cos, sin)
    (gx,) = torch.autograd.grad(got, x, g)
    want = rotate_half(x)
    (wx,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(gx, wx, rtol=0, atol=0)


@torch.no_grad()
def test_the_rotary_tables_class_decides_how_attention_rotates_q_and_k():
    """Attention rotates queries and keys with its tables' `rotate` (a family's tables class may give another
    layout): the default is apply_rotary; a stand-in that does not rotate makes the model position-blind."""
    from meshformer.models.llama.model import RopeTables, Transformer

    seen = []

    class Unrotated(RopeTables):
        rotate = staticmethod(lambda x, cos, sin: seen.append(x.shape) or x)

    class Blind(Transformer):
        rope_tables = Unrotated

    mc = tiny()
    assert RopeTables.rotate is apply_rotary
    model = randomize(create_model(mc, 0))
    blind = Blind(mc)
    blind.load_state_dict(model.state_dict())
    x = tokens(1, 8)
    positions = torch.arange(8)[None]
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    # the same tokens at other rotary positions: other logits with rotation, the same without
    assert not torch.allclose(model(x, positions=positions, mask=mask), model(x, positions=positions + 5, mask=mask))
    assert seen == []
    got = blind(x, positions=positions + 5, mask=mask)
    torch.testing.assert_close(blind(x, positions=positions, mask=mask), got, rtol=0, atol=0)
    assert seen[:2] == [(1, 4, 8, 16), (1, 2, 8, 16)]  # queries then keys, per layer


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rs = RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    mc = tiny(hidden_size=512, num_heads=4, n_kv_heads=4, theta=500000.0, rope_scaling=rs)
    hc = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    want, attn_factor = ROPE_INIT_FUNCTIONS["llama3"](hc, "cpu")
    assert attn_factor == 1.0
    got = rope_inv_freq(mc)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=0)
    # The test must cover all three regimes: unscaled, divided by factor, and smoothly interpolated.
    plain = rope_inv_freq(tiny(hidden_size=512, num_heads=4, n_kv_heads=4, theta=500000.0)).float()
    ratio = plain / got.float()
    assert (ratio - 1).abs().min() < 1e-6 and (ratio - 8).abs().min() < 1e-5
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


# ---------------------------------------------------------------- attention structure


def test_causal_mask_future_tokens_never_change_earlier_logits():
    m = randomize(create_model(tiny(), 0))
    x = tokens()
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % VOCAB
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert (a[:, 9:] - b[:, 9:]).abs().amax() > 1e-3  # and the change does reach position 9 onward


@torch.no_grad()
def test_gqa_equals_explicit_repeat_interleave_of_kv_heads():
    gqa = randomize(create_model(tiny(n_kv_heads=2), 0))
    mha = create_model(tiny(n_kv_heads=4), 0)
    sd = gqa.state_dict()
    hd, rep = 16, 2
    for k, v in list(sd.items()):
        if k.endswith(("k_proj.weight", "v_proj.weight")):  # [n_kv*hd, hidden] -> each kv head repeated
            sd[k] = v.view(2, hd, -1).repeat_interleave(rep, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd, strict=True)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- parity with transformers


def _hf_parity(mc: ModelConfig, hf_cls, hf_cfg):
    ours = randomize(create_model(mc, 0))
    hf = hf_cls(hf_cfg).eval()
    sd = {(k if k == "lm_head.weight" else "model." + k): v for k, v in ours.state_dict().items()}
    if mc.tie_word_embeddings:
        assert "lm_head.weight" not in sd
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True)
    if mc.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = tokens()
    with torch.no_grad():
        want = hf(x).logits
        got = ours(x)
    assert want.abs().amax() > 0.1  # non-trivial logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _hf_common(mc: ModelConfig, **kw) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.n_kv_heads,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.theta,
        max_position_embeddings=mc.seq_length,
        tie_word_embeddings=mc.tie_word_embeddings,
        attn_implementation="eager",
        **kw,
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_logits_match_transformers(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = tiny(tie_word_embeddings=tied, theta=50000.0)
    _hf_parity(mc, LlamaForCausalLM, LlamaConfig(**_hf_common(mc)))


def test_qwen2_qkv_bias_logits_match_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mc = tiny(type="Qwen2Config", qkv_has_bias=True, theta=1e6, rms_norm_eps=1e-6)
    assert create_model(mc, 0).layers["0"].self_attn.q_proj.bias is not None
    _hf_parity(mc, Qwen2ForCausalLM, Qwen2Config(**_hf_common(mc)))


def test_qwen3_qk_norm_logits_match_transformers():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32 != hidden/heads = 16, as in real Qwen3 models.
    mc = tiny(type="Qwen3Config", use_qk_norm=True, head_dim=32, theta=1e6, rms_norm_eps=1e-6)
    _hf_parity(mc, Qwen3ForCausalLM, Qwen3Config(**_hf_common(mc, head_dim=32)))


# ---------------------------------------------------------------- mixed precision


@torch.no_grad()
def test_bf16_compute_with_fp32_norms_stays_close_to_fp32():
    mc = tiny(compute_dtype="bfloat16", layernorm_compute_dtype="float32")
    m32 = randomize(create_model(mc, 0))
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    x = tokens()
    ref = m32(x)
    out = m16(x)
    assert out.dtype == torch.bfloat16
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 0.03, rel
    assert (out.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    # Autocast (the other common way to run bf16) agrees as well.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = m32(x)
    assert (auto.float() - ref).norm() / ref.norm() < 0.03
    # The norm really computes in fp32: bf16 in, exactly the fp32 result rounded to bf16 out.
    norm = m16.layers["0"].input_layernorm
    h = torch.randn(2, 5, 64).to(torch.bfloat16) * 30
    hf = h.float()
    want = (norm.weight.float() * hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(torch.bfloat16)
    assert torch.equal(norm(h), want)
    assert isinstance(norm, RMSNorm) and norm.compute_dtype == torch.float32


# ---------------------------------------------------------------- deterministic init


def test_init_is_deterministic_per_seed():
    mc = tiny()
    a, b, c = create_model(mc, 7), create_model(mc, 7), create_model(mc, 8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    matrices = [k for k in sa if sa[k].dim() == 2]
    assert matrices and all(not torch.equal(sa[k], sc[k]) for k in matrices)
    # Distinct parameters get distinct draws (not one stream reused), and the std follows init_std.
    assert not torch.equal(sa["layers.0.self_attn.k_proj.weight"], sa["layers.1.self_attn.k_proj.weight"])
    assert abs(sa["embed_tokens.weight"].std().item() - mc.init_std) < 0.002
    assert torch.equal(sa["layers.0.input_layernorm.weight"], torch.ones(64))


def test_pipeline_stage_initialises_like_the_full_model():
    mc = tiny(num_layers=3)
    full = create_model(mc, 3).state_dict()
    stage = build_model(mc)  # meta device, as a pipeline rank builds it
    del stage.layers["0"]
    stage.embed_tokens = None
    materialize(stage, "cpu", 3)
    part = stage.state_dict()
    assert set(part) == {k for k in full if not k.startswith(("layers.0.", "embed_tokens."))}
    for k, v in part.items():
        assert torch.equal(v, full[k]), k


# ---------------------------------------------------------------- KV cache


@torch.no_grad()
def test_kv_cache_incremental_decoding_equals_full_forward():
    m = randomize(create_model(tiny(), 0))
    x = tokens()
    full = m(x)
    cache = m.new_kv_cache(2, 16)
    parts = [m(x[:, :10], cache), m(x[:, 10:11], cache), m(x[:, 11:13], cache), m(x[:, 13:], cache)]
    assert cache.pos == 16
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_kv_cache_decoding_past_seq_length():
    # seq_length 8 (the rotary table's size) but 14 tokens decoded: positions past the table are computed
    # on the fly and must equal a model whose table is long enough.
    short = randomize(create_model(tiny(seq_length=8), 0))
    long = create_model(tiny(seq_length=16), 0)
    long.load_state_dict(short.state_dict(), strict=True)
    x = tokens(1, 14)
    cache = short.new_kv_cache(1, 14)
    steps = [short(x[:, :6], cache)] + [short(x[:, i : i + 1], cache) for i in range(6, 14)]
    torch.testing.assert_close(torch.cat(steps, 1), long(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [{}, {"tie_word_embeddings": True}, {"qkv_has_bias": True, "use_qk_norm": True}, {"n_kv_heads": 1, "head_dim": 8}],
)
def test_param_count_from_the_config_equals_the_built_model(kw):
    from meshformer.models.llama import param_count

    mc = tiny(**kw)
    assert param_count(mc) == num_params(build_model(mc))


def test_a_module_may_declare_the_constant_its_parameters_start_at():
    """`init_fill` on a module (a (1 + weight) norm's 0) replaces the rule by name; the
    other parameters draw the same numbers as without it."""
    from meshformer.models.init import init_weights

    mc = model_config(hidden_size=32, num_layers=2, num_heads=4, vocab_size=64, intermediate_size=64)
    plain, marked = create_model(mc, 0), create_model(mc, 0)
    marked.layers["1"].input_layernorm.init_fill = 0.0
    init_weights(marked, 0)
    for (name, a), (_, b) in zip(plain.named_parameters(), marked.named_parameters()):
        if name == "layers.1.input_layernorm.weight":
            assert torch.equal(b, torch.zeros_like(a)) and torch.equal(a, torch.ones_like(a))
        else:
            assert torch.equal(a, b), name
