"""Dataset formats by data_loader.type: one registered here trains and resumes through the real trainer; the
tokenizer comes from the config; prefetched batches equal batches built on demand, and a worker's error is its
one line in the step that needed the batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import EMPTY, fails, tiny_overrides
from meshformer.cli.main import main
from meshformer.config import load_config
from meshformer.data.protocol import Sample, identity
from meshformer.data.registry import dataset_formats, register_dataset_format, unregister_dataset_format
from meshformer.data.tokenizer import tokenizer_hash
from meshformer.errors import UserError
from meshformer.parallel import init_parallel
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.train.data import TrainingData

ROWS = 64  # rows of the training split (the validation split: a quarter of that)


class TokenRows:
    """In-memory token rows drawn from the seed in dataset_dir; with packing, two documents per row and a loss mask
    over the second, so every field of a Sample reaches the batch."""

    tokenizer_hash = vocab_size = tokenizer_file = None

    def __init__(self, seed: int, split: str, seq_length: int, packing: bool, fail_at: int | None = None):
        g = torch.Generator().manual_seed(seed * 2 + (split == "validation"))
        self.rows = torch.randint(0, 512, (ROWS if split == "train" else ROWS // 4, seq_length + 1), generator=g)
        self.packing, self.fail_at, self.cut = packing, fail_at, seq_length // 3

    def __len__(self) -> int:
        return len(self.rows)

    def sample(self, i: int) -> Sample:
        if i == self.fail_at:
            raise UserError(f"token rows: row {i} is unreadable")
        if not self.packing:
            return Sample(self.rows[i])
        documents = (torch.arange(self.rows.shape[1]) >= self.cut).long()
        return Sample(self.rows[i], loss_mask=documents.bool(), documents=documents)

    def state_dict(self) -> dict:
        return identity(self, "token-rows")


def _open_rows(dl, split: str, seq_length: int, field: str) -> TokenRows:
    return TokenRows(int(dl.dataset_dir), split, seq_length, dl.packing)


def _open_failing_rows(dl, split: str, seq_length: int, field: str) -> TokenRows:
    return TokenRows(int(dl.dataset_dir), split, seq_length, dl.packing, fail_at=13)


@pytest.fixture(autouse=True, scope="module")
def registered_formats():
    """The two formats exist while this file's tests run, and not for other files' (docs/config.md lists the
    registered names)."""
    register_dataset_format("TokenRows", _open_rows)
    register_dataset_format("FailingRows", _open_failing_rows)
    yield
    unregister_dataset_format("TokenRows")
    unregister_dataset_format("FailingRows")


def overrides(out: Path, extra: dict | None = None, data_seed: int = 7) -> list[str]:
    return tiny_overrides(Path(str(data_seed)), out, {"train_dataset.data_loader.type": "TokenRows", **(extra or {})})


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def training_data(argv: list[str]) -> TrainingData:
    cfg = load_config(None, argv)
    env = init_parallel(cfg)
    return TrainingData(cfg, env, BatchPlan.from_config(cfg, env.dims), lambda line: None)


def test_registered_names_are_the_config_choices(capsys):
    assert {"MindDataset", "TokenRows"} <= set(dataset_formats())
    assert load_config(None, ["--train_dataset.data_loader.type", "TokenRows"]).train_dataset.data_loader.type
    line = fails(capsys, ["train", EMPTY, "--train_dataset.data_loader.type", "TokenRow"], "did you mean 'TokenRows'")
    assert "MindDataset" in line


def test_a_registered_format_trains_and_resumes_exactly(tmp_path, capsys):
    from meshformer.train.trainer import run_training

    common = {"lr_schedule.total_steps": 8, "callbacks": "[{type: CheckpointMonitor, save_checkpoint_steps: 4}]"}
    run_training(load_config(None, overrides(tmp_path / "full", {**common, "runner_config.stop_step": 8})))
    part = tmp_path / "part"
    run_training(load_config(None, overrides(part, {**common, "runner_config.stop_step": 4})))
    resumed = {**common, "runner_config.stop_step": 8, "resume_training": True}
    with pytest.raises(UserError, match="differs from the data the checkpoint was trained on"):
        run_training(load_config(None, overrides(part, resumed, data_seed=8)))
    run_training(load_config(None, overrides(part, resumed)))
    full, again = metrics(tmp_path / "full"), metrics(part)
    assert [r["step"] for r in again] == list(range(1, 9))
    assert [r["loss"] for r in full] == [r["loss"] for r in again]
    ckpt = part / "checkpoint" / "step_00000008"
    assert (ckpt / "trainer_state.json").is_file() and not (ckpt / "tokenizer.json").exists()
    # without a tokenizer there is nothing to decode with: one line, not a traceback
    fails(capsys, ["generate", "--checkpoint", str(part), "--prompt", "x"], "tokenizer.json")
    # the weights still export, with one note that the tokenizer is missing
    capsys.readouterr()
    assert main(["export", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    assert "tokenizer" in capsys.readouterr().err
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "hf" / "tokenizer.json").exists()


def test_unknown_type_is_one_line_with_exit_2(tiny_dataset, tmp_path, capsys):
    argv = tiny_overrides(tiny_dataset, tmp_path / "run", {"train_dataset.data_loader.type": "MindDatset"})
    fails(capsys, ["train", EMPTY, *argv], "train_dataset.data_loader.type", "did you mean 'MindDataset'")


def test_the_tokenizer_comes_from_the_config(tiny_dataset, tokenizer_dir, tmp_path, capsys):
    tok = tokenizer_dir / "tokenizer.json"
    rows = overrides(tmp_path / "a")
    none = training_data(rows)
    assert none.tokenizer_bytes is None and none.tokenizer_hash is None and none.tokenizer_side_files == {}
    processor = training_data([*rows, "--processor.tokenizer.tokenizer_file", str(tok)])
    assert processor.tokenizer_bytes == tok.read_bytes() and processor.tokenizer_hash == tokenizer_hash(tok)
    folder = training_data([*rows, "--train_dataset.data_loader.tokenizer", str(tokenizer_dir)])
    assert folder.tokenizer_hash == tokenizer_hash(tok)
    side = folder.tokenizer_side_files
    assert side["tokenizer_config.json"] == (tokenizer_dir / "tokenizer_config.json").read_bytes()
    # the default stays the dataset's own; a configured one must be the tokenizer the dataset was made with
    assert training_data(tiny_overrides(tiny_dataset, tmp_path / "b")).tokenizer_hash == tokenizer_hash(tok)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(tok.read_text()), indent=1))  # the same tokens, other bytes
    with pytest.raises(UserError, match="different tokenizer"):
        training_data([*tiny_overrides(tiny_dataset, tmp_path / "b"), "--processor.tokenizer.vocab_file", str(other)])
    both = ["--do_eval", "true", "--train_dataset.data_loader.tokenizer", str(tok)]
    with pytest.raises(UserError, match="is not the training data's tokenizer"):
        training_data([*rows, *both, "--eval_dataset.data_loader.tokenizer", str(other)])
    for field, value in (
        ("processor.tokenizer.tokenizer_file", str(tmp_path / "missing.json")),
        ("train_dataset.data_loader.tokenizer", str(tmp_path)),
        ("processor.tokenizer.vocab_file", str(tiny_dataset / "meta.json")),
    ):
        with pytest.raises(UserError) as e:
            training_data([*rows, f"--{field}", value])
        assert str(e.value).startswith(field) and "\n" not in str(e.value), e.value
    sp_model = tmp_path / "tokenizer.model"
    sp_model.write_bytes(b"\x0a\x00")
    with pytest.raises(UserError, match="is not a tokenizer.json"):
        training_data([*rows, "--processor.tokenizer.vocab_file", str(sp_model)])


def test_a_mindspore_processor_block_is_read(tmp_path):
    path = tmp_path / "ms.yaml"
    path.write_text(
        "processor:\n  return_tensors: ms\n  type: LlamaProcessor\n  tokenizer:\n    type: LlamaTokenizer\n"
        "    unk_token: '<unk>'\n    eos_token: '</s>'\n    tokenizer_file: /models/tok/tokenizer.json\n"
        "train_dataset:\n  num_parallel_workers: 8\n  python_multiprocessing: false\n  prefetch_size: 2\n"
    )
    notices: list[str] = []
    cfg = load_config(path, notices=notices)
    assert cfg.processor.tokenizer.tokenizer_file == "/models/tok/tokenizer.json"
    assert (cfg.train_dataset.num_parallel_workers, cfg.train_dataset.prefetch_size) == (8, 2)
    ignored = {n.split(" ")[0] for n in notices}
    assert ignored == {
        "processor.return_tensors",
        "processor.type",
        "processor.tokenizer.type",
        "processor.tokenizer.unk_token",
        "processor.tokenizer.eos_token",
        "train_dataset.python_multiprocessing",
    }, notices
    with pytest.raises(UserError, match="processor.tokenizer.tokenizer_fle"):
        load_config(None, ["--processor.tokenizer.tokenizer_fle", "x"])


@pytest.mark.parametrize("packing", [False, True])
def test_prefetched_batches_equal_batches_built_on_demand(tmp_path, packing):
    extra = {"train_dataset.data_loader.packing": packing, "do_eval": True, "eval_dataset.prefetch_size": 2}
    plain = training_data(overrides(tmp_path, {**extra, "train_dataset.prefetch_size": 0}))
    ahead = training_data(
        overrides(tmp_path, {**extra, "train_dataset.prefetch_size": 3, "train_dataset.num_parallel_workers": 2})
    )
    order = [0, 1, 2, 3, 7, 8, 2, 3, 4, 20, 21]  # jumps, as a loss-spike rollback makes, and past one epoch (16)
    for b in order:
        got, want = ahead.train_batch(b), plain.train_batch(b)
        assert all(torch.equal(g, w) if w is not None else g is None for g, w in zip(got, want)), b
    assert (want[2] is not None) == packing
    if packing:  # the mask and the document boundary reached the labels
        assert (want[1] == -100).any() and (want[1] != -100).any()
    evals = [list(d.eval_iter(3)) for d in (ahead, plain)]
    assert len(evals[0]) == len(evals[1]) > 0
    for got, want in zip(*evals):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ahead.close()


def test_a_prefetch_workers_error_surfaces_in_the_step_that_needs_it(tmp_path):
    data = training_data(
        overrides(
            tmp_path,
            {
                "train_dataset.data_loader.type": "FailingRows",
                "train_dataset.data_loader.shuffle": False,
                "train_dataset.prefetch_size": 3,
                "train_dataset.num_parallel_workers": 2,
            },
        )
    )
    for b in range(3):  # batch 3 (rows 12..15) is already being built, and failing, in the background
        data.train_batch(b)
    with pytest.raises(UserError, match=r"^token rows: row 13 is unreadable$"):
        data.train_batch(3)
    data.close()


def test_a_prefetch_workers_error_is_one_line_from_train(tmp_path, capsys):
    argv = overrides(tmp_path / "run", {"train_dataset.data_loader.type": "FailingRows", "runner_config.stop_step": 6})
    fails(capsys, ["train", EMPTY, *argv, "--train_dataset.data_loader.shuffle", "false"], "row 13 is unreadable")
