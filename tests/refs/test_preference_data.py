"""Preference data (data/preference*.py): TRL's and LLaMA-Factory's records, tokenized as TRL 1.16 does (compared with
TRL's own `_prepare_dataset` and collator on the same tokenizer), stored as pairs the trainer reads, shown by
`data samples`, counted by `data stats`, and bad records refused in one line."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import EMPTY, checksums, fails, tiny_overrides
from meshformer.cli.main import main

PLAIN = [
    {"prompt": "The king said", "chosen": " to be or not", "rejected": " hello there"},
    {"prompt": "What light", "chosen": " through yonder window breaks", "rejected": " is that"},
    {"prompt": "O Romeo,", "chosen": " wherefore art thou", "rejected": " where are you"},
    {"prompt": "Good night, sweet ", "chosen": "prince", "rejected": "king"},  # BPE merges across the boundary
]
USER = [{"role": "user", "content": "2+2?"}]
CHAT = [
    {
        "prompt": USER,
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a king."}],
        "chosen": [{"role": "assistant", "content": "Lear."}],
        "rejected": [{"role": "assistant", "content": "A long story about kings."}],
    },
]


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _hf_tokenizer(tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))


def _trl_rows(records, tokenizer_dir, max_length=None, mode="keep_start", kto=False):
    """What TRL 1.16 feeds the model for these records: `_prepare_dataset` (a stub self with the tokenizer it reads),
    then the collator's rows (chosen, rejected) with their completion masks."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl import DPOTrainer, KTOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    tok = _hf_tokenizer(tokenizer_dir)
    trainer = KTOTrainer if kto else DPOTrainer
    stub = SimpleNamespace(_tokenizer=tok, calculate_KL=False)  # KTO: its KL completions are made per batch
    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode=mode)
    ds = trainer._prepare_dataset(stub, datasets.Dataset.from_list(records), tok, args, "train")
    rows = []
    for ex in ds:
        if kto:
            ids = ex["prompt_ids"] + ex["completion_ids"]
            mask = [0] * len(ex["prompt_ids"]) + [1] * len(ex["completion_ids"])
            rows.append([(ids[:max_length] if max_length else ids, mask[:max_length] if max_length else mask)])
            continue
        out = DataCollatorForPreference(pad_token_id=0, max_length=max_length, truncation_mode=mode)([ex])
        n = out["attention_mask"].sum(1).tolist()
        rows.append(
            [(out["input_ids"][r, : n[r]].tolist(), out["completion_mask"][r, : n[r]].tolist()) for r in (0, 1)]
        )
    return rows


def _our_rows(out):
    """(ids, mask) of every sequence in the written train split, grouped per pair (or KTO example)."""
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.fromfile(out / "train.bin", dtype=meta["dtype"]).tolist()
    masks = np.fromfile(out / "train.mask.bin", dtype=np.uint8).tolist()
    offsets = np.load(out / "train.idx.npy")
    seqs = [(tokens[a:b], masks[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    per = 2 if meta["kind"] == "pairs" else 1
    return [seqs[k : k + per] for k in range(0, len(seqs), per)], meta


def _preprocess(tmp_path, records, tokenizer_dir, *extra, name="out"):
    src = _write(tmp_path / f"{name}.jsonl", records)
    out = tmp_path / name
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(out)]
    assert main([*argv, "--val-fraction", "0", *extra]) == 0
    return out


@pytest.mark.parametrize("records", [PLAIN, CHAT], ids=["standard", "conversational"])
def test_trl_records_give_trls_token_ids(tmp_path, tokenizer_dir, records):
    ours, meta = _our_rows(_preprocess(tmp_path, records, tokenizer_dir))
    assert meta["kind"] == "pairs" and meta["report"]["pairs"] == len(records)
    assert ours == _trl_rows(records, tokenizer_dir)
    eos = meta["eos_token_id"]
    if records is PLAIN:  # EOS appended to a text completion, counted in it
        assert all(chosen[0][-1] == eos and rejected[0][-1] == eos for chosen, rejected in ours)


def test_implicit_prompt_is_the_shared_prefix_as_in_trl(tmp_path, tokenizer_dir):
    records = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in PLAIN]
    ours, _ = _our_rows(_preprocess(tmp_path, records, tokenizer_dir))
    assert ours == _trl_rows(records, tokenizer_dir)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_max_length_cuts_and_drops_as_trl(tmp_path, tokenizer_dir, mode, capsys):
    records = [
        *PLAIN,
        {"prompt": "Now is the winter of our discontent made glorious", "chosen": " x", "rejected": " y"},
    ]
    out = _preprocess(tmp_path, records, tokenizer_dir, "--max-length", "6", "--truncation-mode", mode)
    ours, meta = _our_rows(out)
    theirs = _trl_rows(records, tokenizer_dir, max_length=6, mode=mode)
    assert ours == theirs and all(len(ids) <= 6 for pair in ours for ids, _ in pair)
    report = meta["report"]
    assert report["dropped_prompt_too_long"] == len(records) - len(theirs) == (3 if mode == "keep_start" else 0)
    full = _trl_rows(records, tokenizer_dir)
    kept = [pair for pair in full if mode == "keep_end" or pair[0][1].index(1) < 6]
    assert report["sequences_cut"] == sum(len(ids) > 6 for pair in kept for ids, _ in pair) > 0
    assert "dropped (prompt alone fills max_length)" in capsys.readouterr().out


def test_cutoff_len_is_read_as_max_length(tmp_path, tokenizer_dir):
    ours, meta = _our_rows(_preprocess(tmp_path, PLAIN, tokenizer_dir, "--cutoff-len", "5"))
    assert meta["max_length"] == 5 and all(len(ids) <= 5 for pair in ours for ids, _ in pair)


def test_llama_factory_ranking_records_are_the_conversations_trl_reads(tmp_path, tokenizer_dir):
    alpaca = [{"instruction": "Name a king.", "input": "", "system": "Be brief.", "chosen": "Lear.", "rejected": "No."}]
    sharegpt = [
        {
            "conversations": [{"from": "human", "value": "Name a king."}],
            "system": "Be brief.",
            "chosen": {"from": "gpt", "value": "Lear."},
            "rejected": {"from": "gpt", "value": "No."},
        }
    ]
    trl_form = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a king."}],
            "chosen": [{"role": "assistant", "content": "Lear."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        }
    ]
    theirs = _trl_rows(trl_form, tokenizer_dir)
    assert _our_rows(_preprocess(tmp_path, alpaca, tokenizer_dir, name="a"))[0] == theirs
    assert _our_rows(_preprocess(tmp_path, sharegpt, tokenizer_dir, name="s"))[0] == theirs
    json_array = tmp_path / "pairs.json"  # LLaMA-Factory's .json arrays read as its JSONL
    json_array.write_text(json.dumps(alpaca))
    out = tmp_path / "arr"
    assert (
        main(["preprocess", "--input", str(json_array), "--tokenizer", str(tokenizer_dir), "--output", str(out)]) == 0
    )
    assert _our_rows(out)[0] == theirs


def test_kto_records_give_trls_token_ids_and_labels(tmp_path, tokenizer_dir):
    records = [
        {"prompt": "The king said", "completion": " to be or not", "label": True},
        {"prompt": "What light", "completion": " is that", "label": False},
        {"prompt": USER, "completion": [{"role": "assistant", "content": "5"}], "label": False},
    ]
    ours, meta = _our_rows(_preprocess(tmp_path, records[:2], tokenizer_dir, name="plain"))
    assert meta["kind"] == "unpaired" and ours == _trl_rows(records[:2], tokenizer_dir, kto=True)
    assert (meta["report"]["desirable"], meta["report"]["undesirable"]) == (1, 1)
    assert np.fromfile(tmp_path / "plain" / "train.label.bin", dtype=np.uint8).tolist() == [1, 0]
    chat, _ = _our_rows(_preprocess(tmp_path, records[2:], tokenizer_dir, name="chat"))
    assert chat == _trl_rows(records[2:], tokenizer_dir, kto=True)
    tagged = [{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "5"}], "kto_tag": False}]
    assert _our_rows(_preprocess(tmp_path, tagged, tokenizer_dir, name="tag"))[0] == chat


def _config_overrides(data, tmp_path):
    extra = {"train_dataset.data_loader.dataset_dir": str(data), "model.model_config.seq_length": 32}
    return tiny_overrides(data, tmp_path / "run", extra)


def test_data_samples_show_a_pair_with_its_masks_and_stats_count_pairs(tmp_path, tokenizer_dir, capsys):
    data = _preprocess(tmp_path, PLAIN * 2, tokenizer_dir)
    pairs, _ = _our_rows(data)
    overrides = _config_overrides(data, tmp_path)
    capsys.readouterr()
    assert main(["data", "samples", EMPTY, "--count", "2", "--json", *overrides]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for row in rows:
        chosen, rejected = pairs[row["sample"]]
        n, m = len(chosen[0]), len(rejected[0])
        assert row["tokens"][:n] == chosen[0] and row["rejected_tokens"][:m] == rejected[0]
        assert row["loss_mask"][: n - 1] == chosen[1][1:n] and row["rejected_loss_mask"][: m - 1] == rejected[1][1:m]
        assert sum(row["loss_mask"]) == sum(chosen[1]) and sum(row["rejected_loss_mask"]) == sum(rejected[1])
    for data_type in ("MindDataset", "PreferenceDataset"):  # the registry's entry, or found from meta.json
        assert main(["data", "stats", EMPTY, "--json", *overrides, "--train_dataset.data_loader.type", data_type]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["kind"] == "pairs" and stats["pairs"] == stats["samples"] == 8
        assert stats["preprocess_identical_pairs"] == 0


def test_the_format_name_is_written_and_read_the_same():
    from meshformer.data import dataset, preference

    assert preference.FORMAT == dataset.PREFERENCE_FORMAT


def test_identical_pairs_are_counted_and_kept(tmp_path, tokenizer_dir):
    records = [*PLAIN, {"prompt": "Hail", "chosen": " Caesar", "rejected": " Caesar"}]
    ours, meta = _our_rows(_preprocess(tmp_path, records, tokenizer_dir))
    assert meta["report"]["identical_pairs"] == 1 and len(ours) == 5 and ours[4][0] == ours[4][1]


@pytest.mark.parametrize(
    "records, needles",
    [
        ([PLAIN[0], {"prompt": "x", "rejected": " y"}], ("pairs.jsonl:2", "'chosen'")),
        ([PLAIN[0], {"prompt": "x", "chosen": "  ", "rejected": " y"}], ("pairs.jsonl:2", "'chosen' is empty")),
        ([{"prompt": "x", "chosen": 3, "rejected": " y"}], ("pairs.jsonl:1", "'chosen' is a JSON number")),
        ([{"prompt": "x", "completion": " y", "label": "yes"}], ("pairs.jsonl:1", "'label'", "true")),
        ([{"conversations": [{"from": "gpt", "value": "a"}], "chosen": {"from": "gpt", "value": "b"},
           "rejected": {"from": "gpt", "value": "c"}}], ("pairs.jsonl:1", "human's turn")),
    ],
)  # fmt: skip
def test_bad_preference_records_are_one_line_and_change_nothing(tmp_path, tokenizer_dir, capsys, records, needles):
    src = _write(tmp_path / "pairs.jsonl", records)
    before = checksums(tmp_path)
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "o")]
    fails(capsys, argv, *needles)
    assert checksums(tmp_path) == before


def test_a_prompt_longer_than_max_length_everywhere_is_refused(tmp_path, tokenizer_dir, capsys):
    src = _write(tmp_path / "pairs.jsonl", PLAIN)
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "o")]
    fails(capsys, [*argv, "--max-length", "2"], "no usable preference examples", "all 4", "max_length=2")
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_that_adds_bos_gives_trls_ids(tmp_path, tokenizer_dir):
    """The BOS the tokenizer's post-processor adds comes once, at the start of the prompt, as in TRL."""
    from tokenizers import Tokenizer, processors

    bos_dir = tmp_path / "bos_tok"
    bos_dir.mkdir()
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    single = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), single])
    tok.save(str(bos_dir / "tokenizer.json"))
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    (bos_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    ours, _ = _our_rows(_preprocess(tmp_path, PLAIN, bos_dir))
    assert all(chosen[0][0] == bos and chosen[0][1] != bos for chosen, _ in ours)
    assert ours == _trl_rows(PLAIN, bos_dir)


@pytest.mark.parametrize(
    "fmt, records, needles",
    [
        ("kto", PLAIN[:1], ("pairs.jsonl:1", "'completion' is missing")),
        ("preference", [{"instruction": "a", "output": "b"}], ("pairs.jsonl:1", "'chosen' and 'rejected' missing")),
        ("auto", [{"conversations": [{"from": "human", "value": "a"}], "kto_tag": True}], ("pairs.jsonl:1", "kto_tag")),
    ],
)
def test_format_forces_the_kind_and_refuses_what_does_not_fit(tmp_path, tokenizer_dir, capsys, fmt, records, needles):
    src = _write(tmp_path / "pairs.jsonl", records)
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(tmp_path / "o")]
    fails(capsys, [*argv, "--format", fmt], *needles)
