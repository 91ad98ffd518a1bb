"""`generate --chat` streams and keeps a conversation, proven against transformers.

A tiny random Llama that transformers builds and saves, with the byte-level tokenizer of `tiny_dataset` (ChatML
template), imported as a meshformer checkpoint. Its head rows for the stop tokens are zero, so greedy replies
never end early and every turn runs to --max-new-tokens. The ids fed for each turn must equal transformers'
`apply_chat_template` of the whole history, and the greedy tokens transformers' `generate`.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import HF_SMALL, save_hf_model
from meshformer.cli.main import main

transformers = pytest.importorskip("transformers")

STOP_IDS = (0, 3)  # <|endoftext|> (eos) and <|im_end|> of the tiny tokenizer
N = 8  # new tokens per turn in the in-process tests


@pytest.fixture(scope="module")
def tiny_chat(tiny_dataset, tmp_path_factory):
    """(the imported checkpoint, transformers' model, transformers' tokenizer of the checkpoint's files)."""
    root = tmp_path_factory.mktemp("chat")

    def silence_stop_tokens(model):
        model.lm_head.weight[list(STOP_IDS)] = 0.0  # logit 0: below the largest of 510 random logits

    config = {**HF_SMALL, "num_key_value_heads": 2}
    hf = save_hf_model(root / "hf", tiny_dataset.parent / "tok", config, before_save=silence_stop_tokens)
    assert main(["import", str(root / "hf"), "--output", str(root / "ckpt")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(root / "ckpt"))
    return root / "ckpt", hf, tok


def hf_turn(hf, tok, history: list[dict], n: int) -> tuple[list[int], str]:
    """(the ids transformers feeds for the next reply, its greedy reply as text)."""
    ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ids = list(ids)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=1)
    new = out[0, len(ids) :].tolist()
    assert len(new) == n and not set(new) & set(STOP_IDS)  # the head's zero rows did keep the stops out
    return ids, tok.decode(new, skip_special_tokens=True).strip()


def test_scripted_conversation_feeds_the_whole_history_and_matches_transformers(
    tiny_chat, tmp_path, monkeypatch, capsys
):
    from meshformer.models import generate as gen

    ckpt, hf, tok = tiny_chat
    fed, streamed = [], []
    real = gen.generate_stream

    def watch(model, ids, *a, **kw):  # record what each turn feeds, and the model, for the non-streamed reference
        fed.append(list(ids))
        streamed.append((model, kw))
        yield from real(model, ids, *a, **kw)

    monkeypatch.setattr(gen, "generate_stream", watch)
    script = [
        {"role": "user", "content": "Who is there?"},
        {"role": "assistant", "content": "Nay, answer me: stand, and unfold yourself."},
        {"role": "user", "content": "Long live the king!"},
        {"role": "user", "content": "And after that?"},
    ]
    (tmp_path / "talk.json").write_text(json.dumps(script))
    argv = ["generate", "--checkpoint", str(ckpt), "--messages", str(tmp_path / "talk.json"), "--greedy"]
    argv += ["--max-new-tokens", str(N), "--system", "You are Horatio.", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(fed) == 2  # the first user turn already has its answer; the other two get one each

    history = [{"role": "system", "content": "You are Horatio."}, *script[:3]]
    ids1, reply1 = hf_turn(hf, tok, history, N)
    history += [{"role": "assistant", "content": reply1}, script[3]]
    ids2, reply2 = hf_turn(hf, tok, history, N)
    assert fed == [ids1, ids2]  # turn 2 sees the whole conversation, its own first reply included
    assert out == f"{reply1}\n\n{reply2}\n"
    # Streamed text equals the non-streamed greedy tokens decoded at the end.
    model, kw = streamed[0]
    for ids, reply in zip(fed, (reply1, reply2)):
        new = gen.generate(model, ids, N, greedy=True, eos_id=kw["eos_id"])
        assert tok.decode(new, skip_special_tokens=True).strip() == reply

    # JSONL spelling, --json: the same replies, one object per answered turn.
    lines = "\n".join(json.dumps(m) for m in script)
    (tmp_path / "talk.jsonl").write_text(lines + "\n")
    argv[4] = str(tmp_path / "talk.jsonl")
    assert main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["prompt"], r["completion"], r["tokens"]) for r in rows] == [
        (script[2]["content"], reply1, N),
        (script[3]["content"], reply2, N),
    ]


def test_single_prompt_chat_is_one_turn_of_the_same_conversation(tiny_chat, capsys):
    ckpt, hf, tok = tiny_chat
    argv = ["generate", "--checkpoint", str(ckpt), "--chat", "--prompt", "Hi", "--greedy", "--device", "cpu"]
    assert main([*argv, "--max-new-tokens", str(N)]) == 0
    _, want = hf_turn(hf, tok, [{"role": "user", "content": "Hi"}], N)
    assert capsys.readouterr().out == want + "\n"


def test_stream_text_holds_back_a_partial_character(tiny_dataset):
    from tokenizers import Tokenizer

    from meshformer.cli.generate_chat import StreamText

    tok = Tokenizer.from_file(str(tiny_dataset.parent / "tok" / "tokenizer.json"))
    text = "  Fair 🙂 é,  ünd 漢字  "
    ids = tok.encode(text).ids
    for strip in (False, True):
        stream = StreamText(tok, strip=strip)
        pieces = [stream.push(t) for t in ids]
        pieces.append(stream.finish())
        assert "".join(pieces) == (text.strip() if strip else text)
        assert not any("\ufffd" in p for p in pieces)  # never half a character
        assert "" in pieces[1:-1]  # some byte waited for the rest of its character
    # A plain prompt is decoded with its completion, and only the completion is handed out.
    prompt, rest = tok.encode("To be").ids, tok.encode(" or not 🙂").ids
    stream = StreamText(tok, prefix_ids=prompt)
    assert "".join([*(stream.push(t) for t in rest), stream.finish()]) == " or not 🙂"


def test_bad_chat_input_is_one_line_exit_2(tiny_chat, tmp_path, monkeypatch, capsys):
    import io

    ckpt = str(tiny_chat[0])
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))  # a pipe, not a terminal: no interactive chat
    assert main(["generate", "--checkpoint", ckpt, "--chat"]) == 2
    err = capsys.readouterr().err
    assert "not a terminal" in err and "--messages FILE" in err and err.count("\n") == 1
    bad = {
        "not_json.json": ("[{'role': 'user'}]", "line 1: not JSON"),
        "no_content.jsonl": ('{"role": "user"}\n{"role": "user", "content": "x"}\n', "line 1: give an object"),
        "list_content.json": ('[{"role": "user", "content": ["x"]}]', "message 1: give an object"),
        "no_user.json": ('[{"role": "system", "content": "x"}]', "no 'user' message"),
    }
    for name, (text, needle) in bad.items():
        (tmp_path / name).write_text(text)
        assert main(["generate", "--checkpoint", ckpt, "--messages", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert needle in err and "--messages" in err and err.count("\n") == 1, (name, err)
    (tmp_path / "ok.json").write_text('[{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]')
    cases = [
        (["--messages", str(tmp_path / "ok.json"), "--prompt", "x"], "--messages and --prompt"),
        (["--messages", str(tmp_path / "ok.json"), "--system", "y"], "--system"),
        (["--messages", str(tmp_path / "none.json")], "is not a file"),
        (["--prompt", "x", "--system", "y"], "--system: only with --chat"),
    ]
    for flags, needle in cases:
        assert main(["generate", "--checkpoint", ckpt, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (flags, err)


def _cli(ckpt: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "meshformer", "generate", "--checkpoint", str(ckpt), "--device", "cpu", *flags]


def _read_until(fd: int, done, timeout: float, proc) -> bytes:
    """Bytes from fd until done(bytes) or the timeout (generous: two loaded cores start torch slowly)."""
    got = b""
    end = time.monotonic() + timeout
    while not done(got) and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # a pty's reader sees EIO once the child closed it
                break
            if not chunk:
                break
            got += chunk
        elif proc.poll() is not None:
            break
    return got


def test_text_arrives_while_the_reply_is_still_being_generated(tiny_chat):
    ckpt, hf, tok = tiny_chat
    _, want = hf_turn(hf, tok, [{"role": "user", "content": "Speak!"}], 200)
    # 50,000 tokens take minutes; the first text must come long before.
    proc = subprocess.Popen(
        _cli(ckpt, "--chat", "--prompt", "Speak!", "--greedy", "--max-new-tokens", "50000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        got = _read_until(proc.stdout.fileno(), lambda b: len(b) >= 40, 180, proc)
        still_running = proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert len(got) >= 40 and still_running, got
    assert want.encode().startswith(got)  # what was streamed is the start of the greedy reply


def test_interactive_chat_on_a_terminal_keeps_the_conversation(tiny_chat):
    import pty

    ckpt, hf, tok = tiny_chat
    history = [{"role": "user", "content": "Hi"}]
    _, reply1 = hf_turn(hf, tok, history, N)
    history += [{"role": "assistant", "content": reply1}, {"role": "user", "content": "Again"}]
    _, reply2 = hf_turn(hf, tok, history, N)

    def shown(text: str) -> bytes:  # the terminal turns "\n" into "\r\n"
        return text.encode().replace(b"\n", b"\r\n")

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        _cli(ckpt, "--chat", "--greedy", "--max-new-tokens", str(N)), stdin=slave, stdout=slave, stderr=slave
    )
    os.close(slave)
    try:
        got = _read_until(master, lambda b: b.endswith(b"> "), 180, proc)
        assert b"/exit" in got and got.endswith(b"> "), got  # the hint, then the first prompt
        os.write(master, b"Hi\n")
        got = _read_until(master, lambda b: shown(reply1 + "\n\n> ") in b, 120, proc)
        assert shown(reply1 + "\n\n> ") in got, (got, reply1)
        os.write(master, b"Again\n")
        got = _read_until(master, lambda b: shown(reply2 + "\n\n> ") in b, 120, proc)
        assert shown(reply2 + "\n\n> ") in got, (got, reply2)
        os.write(master, b"/exit\n")
        _read_until(master, lambda b: False, 60, proc)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        os.close(master)
