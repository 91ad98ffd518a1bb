"""`meshformer template check`: a sound template passes; a tokenizer without the template's special tokens fails;
and train/serve agreement: an exported fine-tune re-renders its held-out conversations to exactly the tokens and
loss mask it was trained on."""

from __future__ import annotations

import json

from conftest import tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.train.trainer import run_training


def test_template_check_flags_tokens_the_tokenizer_lacks(tiny_dataset, capsys):
    tok = tiny_dataset.parent / "tok"  # meshformer's tokenizer: ChatML's tokens and template
    assert main(["template", "check", str(tok)]) == 0
    assert main(["template", "check", str(tok), "--template", "llama3"]) == 1
    out = capsys.readouterr().out
    assert "the template writes '<|start_header_id|>' but the tokenizer encodes it as" in out


def test_an_exported_fine_tune_renders_its_held_out_data_as_trained(tiny_dataset, tmp_path, capsys):
    tok = tiny_dataset.parent / "tok"
    rows = [
        {"messages": [{"role": "user", "content": f"Count to {i}."}, {"role": "assistant", "content": f"{i}!"}]}
        for i in range(40)
    ]
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = tmp_path / "data"
    assert (
        main(
            ["preprocess", "--input", str(src), "--tokenizer", str(tok), "--output", str(data), "--val-fraction", "0.1"]
        )
        == 0
    )
    run_training(load_config(None, tiny_overrides(data, tmp_path / "run", {"runner_config.stop_step": 2})))
    assert main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert main(["template", "check", str(tmp_path / "hf"), "--data", str(data)]) == 0
    assert "4 held-out conversations" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("'\\n'", "'\\n\\n'")  # a template edited after training
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert main(["template", "check", str(tmp_path / "hf"), "--data", str(data)]) == 1
    assert "renders to other tokens or another loss mask" in capsys.readouterr().out
