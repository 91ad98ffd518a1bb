"""Hostile and damaged data input is bounded and one line: chat templates render on a budget (a template that
loops without end stops in seconds, naming itself and the limit, while SmolLM2's, Qwen2.5's and Llama 3's render
as transformers renders them), turn text that is not a string is refused with its record's line or array index,
LLaMA-Factory's .json arrays give exactly the samples of the equivalent .jsonl, and truncated or damaged files
(packed and instruction datasets, inputs cut short, empty, binary) are one line, exit 2, and change nothing."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import EMPTY, TURNS, checksums, fails, tiny_overrides, transformers_render
from meshformer.cli.main import main
from meshformer.data import chat
from meshformer.data.chat import BUILTIN, TemplateName, render_chat
from meshformer.data.dataset import PackedDataset, SFTDataset
from meshformer.data.template_check import check_dataset
from meshformer.errors import UserError

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>'"
    " + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}{{- "<|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""  # Qwen2.5-Instruct's tokenizer_config.json chat_template (its tools preamble shortened)


@pytest.fixture(scope="module")
def tok_dir(tiny_dataset) -> Path:
    return tiny_dataset.parent / "tok"  # meshformer's own tokenizer: <|im_start|> and <|im_end|> are special


def preprocess_argv(src, tok_dir, out, *extra) -> list[str]:
    return ["preprocess", "--input", str(src), "--tokenizer", str(tok_dir), "--output", str(out), *extra]


# ---------------------------------------------------------------- chat templates on a budget


LOOPING = {
    "nested_ranges": "{% for a in range(10**6) %}{% for b in range(10**6) %}x{% endfor %}{% endfor %}",
    "nested_silent": "{% for a in range(9999) %}{% for b in range(9999) %}{% endfor %}{% endfor %}",
    "macro_tree": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "repetition": "{{ 'x' * 10**12 }}",
    "power": "{{ 7 ** 1000000000 }}",  # jinja groups ** from the left: 7 ** 10 ** 9 is small
    "wide_format": "{{ '%999999999d' | format(1) }}",
    "huge_argument": "{{ 'x'.center(10**10) }}",
}


@pytest.fixture
def watchdog():
    """Fail (not hang) a test whose render runs on: SIGALRM raises in the main thread after 120 s."""

    def expire(signum, frame):
        raise TimeoutError("the render was not stopped by its budget")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("name", ["nested_ranges", "nested_silent", "macro_tree"])
def test_a_looping_template_stops_in_seconds_as_one_line(tmp_path, tok_dir, capsys, name, watchdog):
    src = tmp_path / "data.jsonl"
    src.write_text(json.dumps({"messages": TURNS}) + "\n")
    template = tmp_path / f"{name}.jinja"
    template.write_text(LOOPING[name])
    before = checksums(tmp_path)
    t0 = time.perf_counter()
    argv = preprocess_argv(src, tok_dir, tmp_path / "out", "--template", str(template))
    fails(capsys, argv, f"chat template {template}", "stopped at its limit (")
    assert time.perf_counter() - t0 < 60, "the budget must stop it long before a user gives up"
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(LOOPING))
def test_every_unbounded_construct_hits_a_limit(name, watchdog):
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=rf"chat template {name}: stopped at its limit \((more than|a |an )"):
        render_chat(TemplateName(LOOPING[name], name), TURNS)
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "llama3", "chatml"])
def test_ordinary_templates_render_as_transformers_does_well_inside_the_budget(name):
    template = {"smollm2": SMOLLM2, "qwen2.5": QWEN25}.get(name) or BUILTIN[name]
    long = [TURNS[0]] + [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(400)]
    for messages in (TURNS, TURNS[1:2], long):
        for gen in (False, True):
            t0 = time.perf_counter()
            got = render_chat(template, messages, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>")
            seconds = time.perf_counter() - t0
            assert got == transformers_render(template, messages, gen)
    steps = chat._compile(template).environment._state.steps  # the last render: 400 turns, generation prompt
    assert 400 <= steps < chat.MAX_STEPS / 20, steps  # counted, and 20x headroom for a 400-turn conversation
    assert seconds < 2.0


# ---------------------------------------------------------------- turn text that is not a string


@pytest.mark.parametrize(
    "record, needle",
    [
        ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}, "is null"),
        ({"messages": [{"role": "user", "content": ["list"]}, {"role": "assistant", "content": "x"}]}, "an array"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 7}]}, "is number"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}, "has no 'content'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            "not all of it text parts",
        ),
        ({"conversations": [{"from": "human", "value": {"a": 1}}, {"from": "gpt", "value": "x"}]}, "is object"),
        ({"instruction": "q", "output": None}, "'output' is null"),
        ({"instruction": ["q"], "output": "a"}, "'instruction' is an array"),
        ({"instruction": "q", "output": "a", "history": [["q0", None]]}, "history[0][1] is null"),
    ],
)
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_turn_text_that_is_not_a_string_is_refused_with_its_record(tmp_path, tok_dir, capsys, record, needle, suffix):
    good = {"messages": TURNS} if "messages" in record else record | {"output": "a", "instruction": "q"}
    if "conversations" in record:
        good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    good.pop("history", None)
    src = tmp_path / f"data{suffix}"
    records = [good, good, record]
    if suffix == ".json":
        src.write_text(json.dumps(records, indent=2))
        where = f"{src}[2]: "
    else:
        src.write_text("\n".join(json.dumps(r) for r in records) + "\n")
        where = f"{src}:3: "
    before = checksums(tmp_path)
    fails(capsys, preprocess_argv(src, tok_dir, tmp_path / "out", "--template", "chatml"), where, needle)
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()


def test_text_parts_are_joined_with_newlines(tmp_path, tok_dir):
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "Just one."}]
    joined = [{"role": "user", "content": "Name a colour.\nJust one."}, {"role": "assistant", "content": "Blue."}]
    samples = []
    for name, turns in [("parts", [{"role": "user", "content": parts}, joined[1]]), ("joined", joined)]:
        src = tmp_path / f"{name}.jsonl"
        src.write_text(json.dumps({"messages": turns}) + "\n")
        assert main(preprocess_argv(src, tok_dir, tmp_path / name, "--template", "chatml", "--val-fraction", "0")) == 0
        ds = SFTDataset(tmp_path / name, "train", 64)
        samples.append((ds[0].tolist(), ds.mask(0).tolist()))
    assert samples[0] == samples[1]


# ---------------------------------------------------------------- LLaMA-Factory's .json arrays


def shapes(i: int) -> list[dict]:
    """The same conversations in the three shapes, with LLaMA-Factory's optional fields."""
    return [
        {"messages": [TURNS[0], {"role": "user", "content": f"Count to {i}."}, {"role": "assistant", "content": "1!"}]},
        {
            "instruction": f"Say {i}.",
            "input": "" if i % 2 else "Loudly.",
            "output": f"{i}!",
            "system": "Be brief.",
            "history": [["Hello?", "Hi."]] if i % 3 == 0 else [],
        },
        {
            "conversations": [{"from": "human", "value": f"Spell {i}."}, {"from": "gpt", "value": str(i)}],
            "system": "You spell.",
        },
    ]


def rows(ds) -> list:
    return [(ds[i].tolist(), ds.mask(i).tolist()) for i in range(len(ds))]


@pytest.mark.parametrize("shape", [0, 1, 2], ids=["messages", "alpaca", "sharegpt"])
def test_json_arrays_give_the_same_samples_as_jsonl(tmp_path, tok_dir, shape):
    records = [shapes(i)[shape] for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "data.json").write_text(json.dumps(records, indent=2, ensure_ascii=False))
    got = {}
    for suffix in ("jsonl", "json"):
        out = tmp_path / f"ds_{suffix}"
        argv = preprocess_argv(tmp_path / f"data.{suffix}", tok_dir, out, "--template", "chatml")
        assert main([*argv, "--val-fraction", "0.25"]) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert meta["report"]["samples"] == 8 and meta["splits"]["validation"]["samples"] == 2
        got[suffix] = [rows(SFTDataset(out, split, 96)) for split in ("train", "validation")]
        n, problems = check_dataset(tok_dir, out)  # held-out records are found again in the array by index
        assert (n, problems) == (2, [])
    assert got["json"] == got["jsonl"] and len(got["json"][0]) == 6


def test_alpaca_history_and_sharegpt_system_read_as_the_messages_they_mean(tmp_path, tok_dir):
    turns = [("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")]
    messages = [{"role": r, "content": c} for r, c in turns]
    pairs = [
        ({"instruction": "Q2", "output": "A2", "system": "S", "history": [["Q1", "A1"]]}, {"messages": messages}),
        (
            {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}], "system": "S"},
            {"messages": messages[:3]},
        ),
    ]
    for k, pair in enumerate(pairs):
        got = []
        for n, record in enumerate(pair):
            src, out = tmp_path / f"{k}_{n}.json", tmp_path / f"ds_{k}_{n}"
            src.write_text(json.dumps([record]))
            assert main([*preprocess_argv(src, tok_dir, out, "--template", "chatml"), "--val-fraction", "0"]) == 0
            got.append(rows(SFTDataset(out, "train", 96)))
        assert got[0] == got[1] and sum(got[0][0][1]) > 0


def test_a_json_array_of_text_records_packs_like_jsonl(tmp_path, tok_dir):
    docs = [{"text": f"Now is the winter of our discontent, number {i}."} for i in range(6)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "t.json").write_text(json.dumps(docs, indent=1))
    streams = []
    for suffix in ("jsonl", "json"):
        assert main(preprocess_argv(tmp_path / f"t.{suffix}", tok_dir, tmp_path / suffix, "--val-fraction", "0")) == 0
        streams.append(PackedDataset(tmp_path / suffix, "train", 8).tokens.tolist())
    assert streams[0] == streams[1] and len(streams[0]) > 6 * 10


# ---------------------------------------------------------------- damaged inputs and datasets


@pytest.mark.parametrize(
    "name, content, needle",
    [
        (
            "cut.jsonl",
            (json.dumps({"messages": TURNS}) + "\n") * 3 + json.dumps({"messages": TURNS})[:40],
            "cut.jsonl:4",
        ),
        ("cut.json", json.dumps([{"messages": TURNS}] * 3, indent=1)[:-25], "not a valid JSON array"),
        ("object.json", json.dumps({"messages": TURNS}), "a JSON object, not an array of records"),
        ("empty.jsonl", "", "no text in"),
        ("empty.json", "  \n", "no text in"),
        ("blank.txt", "\n\n", "no text in"),
        ("zeros.txt", b"\0" * 4096, "a binary file, not text"),
        ("image.jsonl", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)), "not UTF-8 text"),
        ("nul.jsonl", b'{"text": "a"}\n\0\0\0\0\n', "nul.jsonl:2: binary data"),
        ("latin1.json", '[{"text": "caf\xe9"}]'.encode("latin-1"), "not UTF-8 text"),
    ],
)
def test_damaged_inputs_are_one_line(tmp_path, tok_dir, capsys, name, content, needle):
    src = tmp_path / name
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = checksums(tmp_path)
    fails(capsys, preprocess_argv(src, tok_dir, tmp_path / "out", "--template", "chatml"), needle)
    assert checksums(tmp_path) == before and not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary directory left either


@pytest.fixture(scope="module")
def sft_dataset(tok_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sftfaults")
    (root / "conv.jsonl").write_text("".join(json.dumps(shapes(i)[0]) + "\n" for i in range(24)))
    assert main(preprocess_argv(root / "conv.jsonl", tok_dir, root / "data", "--template", "chatml")) == 0
    return root / "data"


def _cut(name: str, keep: int):
    def damage(d: Path) -> None:
        b = (d / name).read_bytes()
        (d / name).write_bytes(b[: keep if keep >= 0 else len(b) + keep])

    return damage


def _write(name: str, data: bytes):
    return lambda d: (d / name).write_bytes(data)


@pytest.mark.parametrize(
    "kind, damage, needle",
    [
        ("packed", _cut("train.bin", -1000), "train.bin: holds"),
        ("packed", _cut("train.bin", -1), "the dataset is truncated"),
        ("packed", _cut("train.bin", 0), "holds 0 bytes"),
        ("packed", _cut("meta.json", 60), "corrupt meta.json"),
        ("packed", _write("meta.json", b""), "corrupt meta.json"),
        ("sft", _cut("train.bin", -3), "train.bin: holds"),
        ("sft", _cut("train.mask.bin", 0), "train.mask.bin: holds 0 bytes"),
        ("sft", _cut("train.idx.npy", 100), "train.idx.npy: not a readable .npy index"),
        ("sft", _write("train.idx.npy", b"\x80\x04garbage" * 20), "train.idx.npy: not a readable .npy index"),
        ("sft", lambda d: (d / "train.idx.npy").unlink(), "train.idx.npy: missing from the dataset"),
        ("sft", lambda d: np.save(d / "train.idx.npy", np.arange(5)), "does not match meta.json"),
        ("sft", _cut("meta.json", 200), "corrupt meta.json"),
    ],
)
def test_damaged_datasets_are_one_line_at_train(tiny_dataset, sft_dataset, tmp_path, capsys, kind, damage, needle):
    data = tmp_path / "data"
    shutil.copytree(tiny_dataset if kind == "packed" else sft_dataset, data)
    damage(data)
    before = checksums(tmp_path)
    argv = ["train", EMPTY, *tiny_overrides(data, tmp_path / "out"), "--runner_config.stop_step", "1"]
    fails(capsys, argv, needle, "re-run")
    assert checksums(tmp_path) == before and not list((tmp_path / "out").glob("checkpoint*"))
