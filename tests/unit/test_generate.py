"""Generation: cached decoding against an uncached reference loop, the sampling filters against hand-computed
examples, and the `meshformer generate` command with a stand-in checkpoint loader."""

from __future__ import annotations

import math

import pytest
import torch

from meshformer.config.schema import MeshformerConfig
from meshformer.models import create_model
from meshformer.models.generate import generate, generate_batch, next_token, top_k_filter, top_p_filter
from meshformer.models.registry import model_config

VOCAB = 100


@pytest.fixture(scope="module")
def model():
    mc = model_config(
        hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, vocab_size=VOCAB, seq_length=16, intermediate_size=96
    )
    m = create_model(mc, 0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger weights than init gives peaked, prompt-dependent distributions
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return m


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding the slow way: a full forward pass over the whole sequence for every token, no cache."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


PROMPT = [5, 17, 42, 3, 99]


def test_greedy_with_cache_equals_uncached_reference(model):
    # 14 new tokens from a 5-token prompt runs past seq_length=16 (rotary computed on the fly there).
    ref = greedy_reference(model, PROMPT, 14)
    assert len(set(ref)) > 3  # a non-degenerate continuation
    assert generate(model, PROMPT, 14, greedy=True) == ref
    assert generate(model, torch.tensor(PROMPT), 14, temperature=0) == ref  # tensor prompt; T=0 is greedy


def test_a_left_padded_batch_gives_each_prompt_its_own_continuation(model):
    """Prompts of 1, 5 and 9 tokens together: each row continues exactly as its prompt alone (the padding is masked
    and positions start at each prompt), past seq_length too; a row that hits EOS stops while the others go on."""
    prompts = [[7], PROMPT, [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    alone = [greedy_reference(model, p, 10) for p in prompts]
    assert generate_batch(model, prompts, 10, greedy=True) == alone
    eos = alone[1][2]
    want = [a[: a.index(eos) + 1] if eos in a else a for a in alone]
    assert generate_batch(model, prompts, 10, greedy=True, eos_id=eos) == want
    # Logits, not just argmaxes: the padded prefill equals the prompt run alone.
    cache = model.new_kv_cache(2, 12)
    batch = torch.tensor([[7, 7, 7, 7] + [7], PROMPT])
    docs = torch.tensor([[0, 0, 0, 0, 1], [1] * 5])
    with torch.no_grad():
        got = model(batch, cache, docs)[0, -1]
        assert (got - model(torch.tensor([[7]]))[0, -1]).abs().max() < 1e-5


def test_stops_at_eos_and_includes_it(model):
    ref = greedy_reference(model, PROMPT, 8)
    eos = ref[4]
    stop = ref.index(eos)
    assert generate(model, PROMPT, 8, greedy=True, eos_id=eos) == ref[: stop + 1]
    assert generate(model, PROMPT, 0, greedy=True) == []


def test_tiny_top_p_sampling_equals_greedy(model):
    ref = greedy_reference(model, PROMPT, 8)
    g = torch.Generator().manual_seed(0)
    assert generate(model, PROMPT, 8, top_p=1e-6, generator=g) == ref
    g = torch.Generator().manual_seed(0)
    assert generate(model, PROMPT, 8, top_k=1, temperature=5.0, generator=g) == ref


def test_sampling_is_reproducible_with_a_seeded_generator(model):
    def sample(seed):
        return generate(model, PROMPT, 10, temperature=2.0, generator=torch.Generator().manual_seed(seed))

    a, b, c = sample(123), sample(123), sample(124)
    assert a == b and len(a) == 10
    assert a != c  # 10 draws at T=2 from a 100-token vocabulary: equal by chance is negligible


def test_generate_restores_training_mode(model):
    model.train()
    generate(model, PROMPT, 2, greedy=True)
    assert model.training
    model.eval()


def test_bad_arguments_raise():
    m = create_model(
        model_config(hidden_size=32, num_layers=1, num_heads=2, vocab_size=10, seq_length=8, intermediate_size=32), 0
    )
    for kw in ({"temperature": -1.0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            generate(m, [1, 2], 3, **kw)
    with pytest.raises(ValueError, match="at least one token"):
        generate(m, [], 3)


# ---------------------------------------------------------------- filters


# Probabilities 0.05, 0.5, 0.1, 0.2, 0.15 (deliberately unsorted).
PROBS = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15], dtype=torch.float64)
LOGITS = PROBS.log()


@pytest.mark.parametrize(
    "p, kept",
    [
        (0.0, {1}),  # always at least the most probable token
        (0.4, {1}),  # 0.5 >= 0.4
        (0.6, {1, 3}),  # 0.5 < 0.6, 0.5 + 0.2 = 0.7 >= 0.6
        (0.8, {1, 3, 4}),  # 0.7 < 0.8, 0.85 >= 0.8
        (0.9, {1, 3, 4, 2}),  # 0.85 < 0.9, 0.95 >= 0.9
        (0.99, {0, 1, 2, 3, 4}),
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_filter_hand_computed(p, kept):
    out = top_p_filter(LOGITS, p)
    assert {i for i in range(5) if math.isfinite(out[i])} == kept
    for i in kept:  # kept logits are untouched
        assert out[i] == LOGITS[i]


def test_top_p_filter_works_on_batched_rows():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    out = top_p_filter(rows, 0.6)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False], [False, True, False, True, False]]


def test_top_k_filter():
    out = top_k_filter(LOGITS, 2)
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]
    assert torch.equal(top_k_filter(LOGITS, 0), LOGITS) and torch.equal(top_k_filter(LOGITS, 9), LOGITS)


def test_sampled_frequencies_follow_the_renormalised_nucleus():
    # p = 0.8 keeps tokens 1, 3, 4 with probabilities 0.5, 0.2, 0.15, renormalised by 0.85.
    g = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[next_token(LOGITS, top_p=0.8, generator=g)] += 1
    want = torch.tensor([0, 0.5, 0, 0.2, 0.15]) / 0.85
    assert counts[0] == counts[2] == 0
    assert (counts / n - want).abs().max() < 0.025  # ~4 standard deviations at n=6000
    # Temperature: T=2 samples from softmax(logits / 2), i.e. probabilities proportional to sqrt(p).
    counts.zero_()
    for _ in range(n):
        counts[next_token(LOGITS, temperature=2.0, generator=g)] += 1
    want = PROBS.sqrt().float() / PROBS.sqrt().sum().float()
    assert (counts / n - want).abs().max() < 0.025


# ---------------------------------------------------------------- CLI


def _word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    return tok


@pytest.fixture()
def fake_checkpoint(model, tmp_path, monkeypatch):
    import meshformer.interop as ckpt

    cfg = MeshformerConfig()
    cfg.model.model_config = model.config
    seen = []

    def load_for_inference(path, device=None):
        seen.append(path)
        assert device in (None, "cpu")
        return model, cfg, _word_tokenizer()

    monkeypatch.setattr(ckpt, "load_for_inference", load_for_inference, raising=False)
    return tmp_path, seen


def test_cli_prints_prompt_and_greedy_completion(fake_checkpoint, model, capsys):
    from meshformer.cli.main import main

    path, seen = fake_checkpoint
    rc = main(
        [
            "generate",
            "--checkpoint",
            str(path),
            "--prompt",
            "w5 w17 w42 w3 w99",
            "--greedy",
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0 and seen == [str(path)]
    out = capsys.readouterr().out.strip()
    want = greedy_reference(model, PROMPT, 6)
    assert out == "w5 w17 w42 w3 w99 " + " ".join(f"w{t}" for t in want)


def test_cli_runs_several_prompts_as_one_batch(fake_checkpoint, model, tmp_path, capsys):
    import json

    from meshformer.cli.main import main

    path, _ = fake_checkpoint
    more = tmp_path / "prompts.txt"
    more.write_text("w3 w1 w4 w1 w5 w9 w2\n\nw8\n")
    argv = ["generate", "--checkpoint", str(path), "--prompt", "w5 w17 w42 w3 w99", "--prompts-file", str(more)]
    assert main([*argv, "--greedy", "--max-new-tokens", "6", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    prompts = [PROMPT, [3, 1, 4, 1, 5, 9, 2], [8]]
    assert [r["prompt"] for r in rows] == ["w5 w17 w42 w3 w99", "w3 w1 w4 w1 w5 w9 w2", "w8"]
    for row, prompt in zip(rows, prompts):
        want = " " + " ".join(f"w{t}" for t in greedy_reference(model, prompt, 6))
        assert row["completion"] == want and row["tokens"] == 6
    assert main(["generate", "--checkpoint", str(path), "--prompts-file", str(tmp_path / "none.txt")]) == 2
    assert "--prompts-file" in capsys.readouterr().err


def test_cli_seeded_sampling_is_reproducible(fake_checkpoint, capsys):
    from meshformer.cli.main import main

    path, _ = fake_checkpoint
    argv = [
        "generate",
        "--checkpoint",
        str(path),
        "--prompt",
        "w1 w2",
        "--seed",
        "7",
        "--temperature",
        "2",
        "--top-p",
        "0.9",
        "--top-k",
        "50",
        "--max-new-tokens",
        "8",
    ]
    assert main(argv) == 0
    a = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == a and len(a.split()) == 10


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-k", "-1"], "--top-k"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_cli_bad_flags_exit_2_naming_the_flag(fake_checkpoint, capsys, flags, needle):
    from meshformer.cli.main import main

    path, seen = fake_checkpoint
    assert main(["generate", "--checkpoint", str(path), "--prompt", "w1"] + flags) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert seen == []  # rejected before loading anything


def test_cli_missing_checkpoint_and_bad_prompt(fake_checkpoint, tmp_path, capsys):
    from meshformer.cli.main import main

    path, _ = fake_checkpoint
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "w1"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(path), "--prompt", "   "]) == 2
    assert "--prompt" in capsys.readouterr().err
    # a typo'd length is refused before its KV cache is allocated (10**15 tokens: petabytes even for this model)
    assert main(["generate", "--checkpoint", str(path), "--prompt", "w1", "--max-new-tokens", str(10**15)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshformer: error: --max-new-tokens") and "KV cache alone would take" in err, err


def test_cli_stops_at_the_tokenizers_eos(model, tmp_path, monkeypatch, capsys):
    # The config names no eos_token_id, so the tokenizer's own end-of-text token ("</s>") is used.
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    import meshformer.interop as ckpt
    from meshformer.cli.main import main

    ref = greedy_reference(model, PROMPT, 8)
    eos = ref[2]
    vocab = {("</s>" if i == eos else f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0" if eos else "w1"))
    tok.pre_tokenizer = Whitespace()
    cfg = MeshformerConfig()
    cfg.model.model_config = model.config
    assert cfg.model.model_config.eos_token_id is None
    monkeypatch.setattr(ckpt, "load_for_inference", lambda path, device=None: (model, cfg, tok), raising=False)
    word = {i: w for w, i in vocab.items()}
    prompt = " ".join(word[t] for t in PROMPT)
    assert (
        main(["generate", "--checkpoint", str(tmp_path), "--prompt", prompt, "--greedy", "--max-new-tokens", "8"]) == 0
    )
    words = capsys.readouterr().out.split()
    assert words == prompt.split() + [word[t] for t in ref[: ref.index(eos) + 1]]
    assert len(words) < len(PROMPT) + 8  # it did stop early


def test_cli_end_to_end_with_a_saved_checkpoint(model, tmp_path, capsys):
    # A real checkpoint directory written by the checkpoint store, loaded by load_for_inference. The weights
    # were perturbed away from the seed's init, so a loader that ignored the file would give other tokens.
    import yaml

    from meshformer.checkpoint.saver import save_checkpoint
    from meshformer.cli.main import main
    from meshformer.config import to_dict

    cfg = MeshformerConfig()
    cfg.model.model_config = model.config
    extra = {
        "config.yaml": yaml.safe_dump(to_dict(cfg)).encode(),
        "tokenizer.json": _word_tokenizer().to_str().encode(),
    }
    save_checkpoint(
        tmp_path / "checkpoint" / "step_00000001",
        [model],
        [torch.optim.AdamW(model.parameters())],
        {"step": 1},
        extra,
    )
    prompt = " ".join(f"w{t}" for t in PROMPT)
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path),
                "--prompt",
                prompt,
                "--greedy",
                "--max-new-tokens",
                "5",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    want = generate(model, PROMPT, 5, greedy=True)
    assert capsys.readouterr().out.split() == prompt.split() + [f"w{t}" for t in want]
    assert generate(create_model(model.config, 0), PROMPT, 5, greedy=True) != want  # the file mattered
