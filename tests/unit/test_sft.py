"""Instruction data: the loss mask keeps exactly the assistant's tokens (every turn, with its end-of-turn token),
the three input shapes agree, bad data is one line and writes nothing, and training reads the mask."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import TURNS, checksums, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.data.chat import BUILTIN
from meshformer.data.dataset import SFTDataset
from meshformer.data.sft import encode_sample
from meshformer.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tiny_dataset) -> Path:
    return tiny_dataset.parent / "tok"  # meshformer's own tokenizer: <|im_start|> and <|im_end|> are special


def test_mask_counts_exactly_the_assistant_tokens_of_every_turn(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids, mask, text, spans, _ = encode_sample(tok, BUILTIN["chatml"], TURNS, {}, False, "sample")
    trained = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert trained == "Blue.<|im_end|>\nGreen, like grass.<|im_end|>\n"  # both replies, each with its end token
    assert [text[a:b] for a, b in spans] == ["Blue.<|im_end|>\n", "Green, like grass.<|im_end|>\n"]
    im_end = tok.token_to_id("<|im_end|>")
    assert int(((ids == im_end) & (mask == 1)).sum()) == 2 and int((ids == im_end).sum()) == 5  # one per turn
    ids2, mask2, _, _, _ = encode_sample(tok, BUILTIN["chatml"], TURNS, {}, True, "sample")
    assert np.array_equal(ids, ids2) and mask2.all()  # --train-on-prompt


def test_alpaca_sharegpt_and_messages_give_the_same_samples(tmp_path, tok_dir):
    turns = [{"role": "user", "content": "Say hi.\n\nTo Ann"}, {"role": "assistant", "content": "Hi Ann."}]
    files = {
        "messages": {"messages": turns},
        "alpaca": {"instruction": "Say hi.", "input": "To Ann", "output": "Hi Ann."},
        "sharegpt": {
            "conversations": [{"from": "human", "value": "Say hi.\n\nTo Ann"}, {"from": "gpt", "value": "Hi Ann."}]
        },
    }
    got = {}
    for name, record in files.items():
        src = tmp_path / f"{name}.jsonl"
        src.write_text((json.dumps(record) + "\n") * 4)
        out = tmp_path / f"data_{name}"
        argv = ["preprocess", "--input", str(src), "--tokenizer", str(tok_dir), "--output", str(out)]
        assert main([*argv, "--template", "chatml", "--val-fraction", "0"]) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert meta["format"] == "meshformer-sft-v1" and meta["splits"]["train"]["samples"] == 4
        ds = SFTDataset(out, "train", 32)
        got[name] = (ds[0].tolist(), ds.mask(0).tolist())
        assert (out / "chat_template.jinja").read_text() == BUILTIN["chatml"]  # stored with the data
    assert got["messages"] == got["alpaca"] == got["sharegpt"]


def test_bad_instruction_data_is_one_line_exit_2_and_writes_nothing(tmp_path, tok_dir, capsys):
    no_reply = tmp_path / "no_reply.jsonl"
    no_reply.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    bad_role = tmp_path / "bad_role.jsonl"
    bad_role.write_text(json.dumps({"messages": [{"role": "wizard", "content": "Hi"}]}) + "\n")
    user_only = tmp_path / "user_only.jinja"
    user_only.write_text("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"messages": TURNS}) + "\n")
    cases = [
        (no_reply, [], "no_reply.jsonl:1: no assistant turn"),
        (bad_role, [], "unknown role 'wizard'"),
        (good, ["--template", str(user_only)], "renders nothing for assistant turns"),
        (good, ["--template", "vicuna"], "not a file nor a built-in template"),
    ]
    for src, extra, message in cases:
        before = checksums(tmp_path)
        capsys.readouterr()
        out = tmp_path / "out"
        argv = ["preprocess", "--input", str(src), "--tokenizer", str(tok_dir), "--output", str(out), *extra]
        assert main([*argv, "--format", "messages"]) == 2, message
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
        assert checksums(tmp_path) == before and not out.exists()


def test_a_hundred_sample_overfit_drives_the_loss_to_zero(tmp_path, tok_dir):
    """The seed's check that the fine-tuning path is wired right: 100 samples, trained to a loss near 0."""
    from conftest import CORPUS
    from meshformer.train.trainer import run_training

    speeches = [b.split("\n", 1)[1] for b in CORPUS[0].read_text().split("\n\n") if b.count("\n") >= 1][40:140]
    rows = [
        {"messages": [{"role": "user", "content": f"Speech {i}?"}, {"role": "assistant", "content": s[:120]}]}
        for i, s in enumerate(speeches)
    ]
    src = tmp_path / "codes.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tmp_path / "data"
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tok_dir), "--output", str(data)]
    assert main([*argv, "--template", "chatml", "--val-fraction", "0", "--seq-length", "64"]) == 0
    extra = {
        "model.model_config.hidden_size": 128,
        "model.model_config.intermediate_size": 256,
        "model.model_config.seq_length": 64,
        "train_dataset.batch_size": 20,
        "runner_config.stop_step": 350,
        "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_steps": 10,
        "lr_schedule.type": "cosine",
    }
    run_training(load_config(None, tiny_overrides(data, tmp_path / "run", extra)))
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The median of the last ten steps, with the learning rate decayed to 0 (cosine): at a constant 3e-3 a step's
    # loss wandered by ±0.05 to the end and the band's centre moved with the CPU's kernels (0.057 on an AMX Xeon).
    assert losses[0] > 3 and sorted(losses[-10:])[5] < 0.05, (losses[0], losses[-10:])
