"""Packing instruction samples several per row: a packed sample computes exactly what it computes alone (attention
stays inside it, rotary positions restart), the trainer's loss is the same packed or padded, and layouts that cannot
pack say so. Parallel layouts with packed rows are in the parity suite (variant `packed`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import ROOT, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.data.dataset import SFTDataset, pack_rows
from meshformer.models import build_model, materialize
from meshformer.models.llama import document_positions


def _model(**extra):
    args = ["--model.model_config.hidden_size", "64", "--model.model_config.num_layers", "2"]
    args += ["--model.model_config.num_heads", "8", "--model.model_config.n_kv_heads", "2"]
    args += ["--model.model_config.vocab_size", "100", "--model.model_config.seq_length", "48"]
    args += ["--model.model_config.intermediate_size", "128", "--model.model_config.use_qk_norm", "true"]
    for k, v in extra.items():
        args += [f"--model.model_config.{k}", str(v)]
    model = build_model(load_config(None, args).model.model_config)
    materialize(model, torch.device("cpu"), 3, torch.float32)
    return model


def test_packed_samples_cannot_see_each_other():
    """Three samples in one row give each sample's own logits and gradients; without the document layout the
    second and third would read the first (the control: the same row unmasked differs)."""
    model = _model()
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(100, (1, n), generator=g) for n in (11, 17, 9)]
    row = torch.cat(samples, 1)
    documents = torch.cat([torch.full((1, s.shape[1]), k) for k, s in enumerate(samples)], 1)

    packed = model(row, documents=documents)
    alone = [model(s) for s in samples]
    assert (packed - torch.cat(alone, 1)).abs().max() < 1e-5
    unmasked = model(row)
    assert (unmasked[:, 11:] - torch.cat(alone[1:], 1)).abs().max() > 1e-2  # the mask is what makes them equal

    # Gradients: the packed row's summed loss has the gradient of the samples' losses added.
    def loss(logits, ids):
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")

    model.zero_grad()
    ends = np.cumsum([0] + [s.shape[1] for s in samples])
    sum(loss(packed[:, a:b], row[:, a:b]) for a, b in zip(ends[:-1], ends[1:])).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(loss(model(s), s) for s in samples).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-5), n


def test_document_positions_restart_at_every_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


def test_pack_rows_places_every_sample_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    rows = pack_rows(lengths, 65)
    placed = sorted(i for r in rows for i in r)
    assert placed == list(range(500))
    assert all(sum(int(lengths[i]) for i in r) <= 65 for r in rows)
    assert len(rows) <= int(np.ceil(lengths.sum() / 65 * 1.1))  # best-fit decreasing: within 10% of the bound
    assert all(r == sorted(r) for r in rows)


@pytest.fixture(scope="module")
def sft_data(tiny_dataset, tmp_path_factory):
    """Conversations of varied length, the prompt trained too (so a label across a sample boundary would count)."""
    tok = tiny_dataset.parent / "tok"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Count " + "and then " * (i % 5) + f"to {i}?"},
                {"role": "assistant", "content": " ".join(str(k) for k in range(i % 7 + 1))},
            ]
        }
        for i in range(24)
    ]
    root = tmp_path_factory.mktemp("packing")
    src = root / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["preprocess", "--input", str(src), "--tokenizer", str(tok), "--output", str(root / "data")]
    assert main([*argv, "--template", "chatml", "--val-fraction", "0", "--train-on-prompt"]) == 0
    return root / "data"


def _trainer(data, out, packing: bool):
    from meshformer.train.trainer import Trainer

    extra = {
        "model.model_config.seq_length": 96,
        "train_dataset.batch_size": 1,
        "train_dataset.data_loader.packing": packing,
        "eval_dataset.data_loader.packing": packing,
        "eval_dataset.split": "train",
        "eval_config.eval_iters": 100,
        "do_eval": True,
    }
    return Trainer(load_config(None, tiny_overrides(data, out, extra)))


def test_trainer_loss_is_the_same_packed_or_padded(sft_data, tmp_path):
    """Every sample evaluated once, packed rows against one padded sample per row: the mean token loss agrees.
    It would not if packed samples attended to each other, if positions did not restart, or if the last token of a
    sample were trained to predict the next sample's first."""
    losses, rows = {}, {}
    for packing in (False, True):
        trainer = _trainer(sft_data, tmp_path / f"run_{packing}", packing)
        try:
            losses[packing] = trainer.evaluate()
            rows[packing] = len(trainer.train_ds)
            if packing:
                ds = trainer.train_ds
                docs = ds.documents(0)
                assert docs is not None and int(docs.max()) >= 2  # rows really hold several samples
                trainer.train()  # and it trains
        finally:
            trainer.saver.close()
            trainer.run_dir.unlock()
    assert rows[False] == 24 and rows[True] < 12
    assert abs(losses[True] - losses[False]) < 1e-5 * losses[False], losses


def test_packed_rows_hold_the_padded_samples(sft_data):
    padded, packed = SFTDataset(sft_data, "train", 96), SFTDataset(sft_data, "train", 96, packing=True)
    assert padded.documents(0) is None
    seen = []
    for i in range(len(packed)):
        tokens, mask, docs = packed[i], packed.mask(i), packed.documents(i)
        for k, sample in enumerate(packed.rows[i]):
            n = int(padded.offsets[sample + 1] - padded.offsets[sample])
            at = docs == k
            assert int(at.sum()) == n
            assert torch.equal(tokens[at], padded[sample][:n]) and torch.equal(mask[at], padded.mask(sample)[:n])
            seen.append(sample)
    assert sorted(seen) == list(range(24))


def test_packing_is_refused_where_it_cannot_work(tiny_dataset, sft_data, tmp_path, capsys):
    empty = str(ROOT / "tests" / "empty.yaml")
    pipeline = {"parallel_config.pipeline_stage": 2, "parallel_config.micro_batch_num": 2}
    cases = [
        ("config", sft_data, pipeline, "packing=true is not supported with parallel_config.pipeline_stage=2"),
        ("train", tiny_dataset, {}, "packing=true applies to instruction data"),
    ]
    for verb, data, extra, message in cases:
        args = tiny_overrides(data, tmp_path / "run", {"train_dataset.data_loader.packing": True, **extra})
        capsys.readouterr()
        assert main([verb, *(["check"] if verb == "config" else []), empty, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
        assert not (tmp_path / "run").exists()


def test_compiled_lora_on_packed_rows_matches_eager(sft_data, tmp_path):
    """`compile: auto` compiles every GPU run (and long CPU runs) whatever else the config holds: a LoRA model on
    packed rows (document-masked attention, restarting positions), compiled layers and loss, trains to the eager
    run's losses (fp32: Inductor reorders a few float sums, nothing more)."""
    from torch._dynamo.utils import counters

    from meshformer.train.trainer import run_training

    losses, graphs = {}, {}
    for compiled in (False, True):
        before = counters["stats"]["unique_graphs"]
        out = tmp_path / f"run_{compiled}"
        extra = {
            "model.model_config.seq_length": 96,
            "train_dataset.batch_size": 2,
            "train_dataset.data_loader.packing": True,
            "model.model_config.pet_config": "{pet_type: lora, lora_rank: 4, lora_alpha: 8}",
            "runner_config.stop_step": 3,
            "compile": compiled,
        }
        run_training(load_config(None, tiny_overrides(sft_data, out, extra)))
        graphs[compiled] = counters["stats"]["unique_graphs"] - before
        recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[compiled] = [r["loss"] for r in recs if "loss" in r]
    assert graphs[False] == 0 and graphs[True] >= 2, graphs  # the layers and the loss really were compiled
    assert len(losses[True]) == 3 and losses[True][0] > 0
    for eager, comp in zip(losses[False], losses[True]):
        assert abs(comp - eager) < 1e-4 * eager, losses
