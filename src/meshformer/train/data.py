"""The trainer's data component: the training and validation datasets, their batch order and the tokenizer.

The dataset is whatever `data_loader.type` names (data/registry.py; data/protocol.py says what a format provides).
Global batch b is a pure function of (seed, epoch) and b (data/dataset.py SampleOrder, GlobalBatches), so the
trainer asks for batches by index, they can be built ahead by background threads (data/prefetch.py:
train_dataset.prefetch_size, num_parallel_workers) and a checkpoint records only the step; `state_dict` adds what
identifies the data, so a resume on other data is refused instead of silently reading other samples.

The tokenizer (saved with every checkpoint, checked against the dataset's) is train_dataset.data_loader.tokenizer,
else processor.tokenizer.tokenizer_file / vocab_file, else the one the dataset carries (a MindDataset directory's
tokenizer.json). A format that carries none, with none configured, trains without: tokenizer_bytes and
tokenizer_hash are None and the checkpoints hold no tokenizer.json.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

from torch import Tensor

from meshformer.config.data_schema import DataLoaderConfig
from meshformer.config.schema import MeshformerConfig
from meshformer.data.dataset import GlobalBatches, SampleOrder, pinned, to_device
from meshformer.data.prefetch import Prefetcher
from meshformer.data.protocol import check_same_data, check_tokenizer, check_trains_targets, shuffles
from meshformer.data.registry import open_dataset_for
from meshformer.data.tokenizer import load_tokenizer, tokenizer_hash, vocab_size
from meshformer.errors import UserError
from meshformer.parallel import ParallelEnv
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.train.optim import schedule_warnings
from meshformer.train.preference_step import check_preference_data, preference_rows
from meshformer.train.step import eval_micro_batch

Batch = tuple[Tensor, Tensor, Tensor | None]  # inputs, labels, documents (packed rows; else None)
SIDE_FILES = ("tokenizer_config.json", "chat_template.jinja")  # beside tokenizer.json: special tokens, template


class TrainingData:
    def __init__(self, cfg: MeshformerConfig, env: ParallelEnv, plan: BatchPlan, log: Callable[[str], None]):
        self.cfg, self.env, self.plan, self.log = cfg, env, plan, log
        self.mc = cfg.model.model_config
        # a preference run reads each sample as two rows (data/preference_rows.py, train/preference_step.py)
        self.rows = preference_rows(cfg)
        self._open()
        td = cfg.train_dataset
        self._train_ahead = Prefetcher(self._host_train, td.prefetch_size, td.num_parallel_workers)
        self._state = None

    def _open(self) -> None:
        cfg, field = self.cfg, "train_dataset.data_loader.dataset_dir"
        dl = cfg.train_dataset.data_loader
        self.train_ds = open_dataset_for(
            dl, cfg.train_dataset.split or "train", self.mc.seq_length, "train_dataset.data_loader"
        )
        if hasattr(self.train_ds, "padding"):
            self.log(
                f"instruction data: {self.train_ds.samples} samples in {len(self.train_ds)} rows of "
                f"{self.mc.seq_length + 1} tokens, {self.train_ds.padding:.1%} padding"
                + (" (packed)" if dl.packing else " (one sample per row; packing: true fills rows)")
            )
        if self.rows:
            check_preference_data(cfg, getattr(self.train_ds, "kind", None), self.plan.global_batch)
        self._open_tokenizer()
        check_tokenizer(self.train_ds, self.tokenizer_hash, self.mc.vocab_size, field)
        check_trains_targets(self.train_ds, "train_dataset.data_loader")
        ev = cfg.eval_dataset
        self.eval_ds = None
        self.eval_batches = None
        self.eval_micro_batch = None
        if cfg.do_eval or cfg.eval_config.eval_interval > 0:
            own, eval_dl = eval_data_loader(cfg)
            split = ev.split or "validation"
            self.eval_ds = open_dataset_for(eval_dl, split, self.mc.seq_length, "eval_dataset.data_loader")
            check_own_validation(own, self.eval_ds, dl)
            eval_field = "eval_dataset.data_loader.dataset_dir"
            check_tokenizer(self.eval_ds, self.tokenizer_hash, self.mc.vocab_size, eval_field)
            check_trains_targets(self.eval_ds, "eval_dataset.data_loader")
            if ev.data_loader.tokenizer:  # the run has one tokenizer: the training data's
                tok = configured_tokenizer(
                    ev.data_loader.tokenizer, "eval_dataset.data_loader.tokenizer", self.mc.vocab_size
                )
                if tokenizer_hash(tok) != self.tokenizer_hash:
                    raise UserError(
                        f"eval_dataset.data_loader.tokenizer={ev.data_loader.tokenizer!r} is not the training "
                        f"data's tokenizer: validation data must be made with the same one (leave it unset)"
                    )
            self.eval_micro_batch = eval_micro_batch(cfg, self.plan.micro_batch)
            unit = self.env.dp_size * self.eval_micro_batch  # one eval micro-batch on every data-parallel rank
            if len(self.eval_ds) < unit:
                raise UserError(
                    f"eval_dataset: {len(self.eval_ds)} validation samples of seq_length {self.mc.seq_length} "
                    f"are fewer than one eval micro-batch ({self.eval_micro_batch}) per data-parallel rank "
                    f"({unit} in all): set eval_dataset.batch_size lower, add validation text (preprocess "
                    f"--val-fraction) or lower model.model_config.seq_length"
                )
            # About one training global batch per eval iteration (whole eval micro-batches), split over dp.
            eval_batch = min(max(self.plan.global_batch // unit, 1) * unit, len(self.eval_ds) // unit * unit)
            self.eval_batches = GlobalBatches(
                SampleOrder(len(self.eval_ds), 0, False), eval_batch, self.env.dp_rank, self.env.dp_size
            )
        self.shuffle = shuffles(self.train_ds, dl.shuffle)
        order = SampleOrder(len(self.train_ds), self.cfg.seed, self.shuffle)
        if order.n < self.plan.global_batch:
            raise UserError(
                f"train_dataset: {order.n} samples of seq_length {self.mc.seq_length} are fewer than one "
                f"global batch ({self.plan.describe(cfg, self.env.dims)}): add data or shrink the batch"
            )
        self.batches = GlobalBatches(order, self.plan.global_batch, self.env.dp_rank, self.env.dp_size)
        rc = cfg.runner_config
        self.total_steps = rc.stop_step or rc.epochs * self.batches.per_epoch
        for warning in schedule_warnings(cfg, self.total_steps):
            self.log(f"warning: {warning}")

    def _open_tokenizer(self) -> None:
        """tokenizer_bytes / _side_files / _hash from the configured tokenizer, else the dataset's, else none."""
        dl, pt = self.cfg.train_dataset.data_loader, self.cfg.processor.tokenizer
        given = [
            (f, v)
            for f, v in (
                ("train_dataset.data_loader.tokenizer", dl.tokenizer),
                ("processor.tokenizer.tokenizer_file", pt.tokenizer_file),
                ("processor.tokenizer.vocab_file", pt.vocab_file),
            )
            if v
        ]
        if given:
            field, value = given[0]
            tok = configured_tokenizer(value, field, self.mc.vocab_size)
            self.log(f"tokenizer: {tok} ({field})")
        elif self.train_ds.tokenizer_file is not None:
            tok = Path(self.train_ds.tokenizer_file)
            if not tok.is_file():
                field = "train_dataset.data_loader.dataset_dir"
                raise UserError(f"{field}: {tok} is missing: re-run `meshformer preprocess`")
        else:
            self.tokenizer_bytes, self.tokenizer_side_files, self.tokenizer_hash = None, {}, None
            self.log(
                f"warning: this run will have no tokenizer: train_dataset.data_loader.type {dl.type} carries none "
                f"and none is configured, so its checkpoints hold no tokenizer.json (generate and eval refuse them; "
                f"export writes the weights alone): set processor.tokenizer.tokenizer_file to the one the data was "
                f"made with"
            )
            return
        self.tokenizer_bytes = tok.read_bytes()
        # Saved with every checkpoint, so `export` hands on the special tokens and the template the data was made with.
        side = [tok.parent / name for name in SIDE_FILES]
        self.tokenizer_side_files = {f.name: f.read_bytes() for f in side if f.is_file()}
        self.tokenizer_hash = tokenizer_hash(tok)

    # ---- batches ------------------------------------------------------------------------------------------
    def _host_batch(self, ds, order: GlobalBatches, b: int, field: str) -> Batch:
        batch = order.host_inputs(ds, b, self.mc.vocab_size, self.mc.ignore_token_id, field, self.rows)
        return pinned(batch) if self.env.device.type == "cuda" else batch

    def _host_train(self, b: int) -> Batch:
        return self._host_batch(self.train_ds, self.batches, b, "train_dataset")

    def train_batch(self, b: int) -> Batch:
        """Global batch b's rows for this data-parallel rank, on env.device (built ahead when prefetching)."""
        return to_device(self._train_ahead.get(b), self.env.device)

    def eval_iter(self, iters: int) -> Iterator[Batch]:
        """The first `iters` validation batches (fixed order, so comparable across steps)."""
        order, ev = self.eval_batches, self.cfg.eval_dataset
        n = min(iters, order.per_epoch)
        ahead = Prefetcher(
            lambda b: self._host_batch(self.eval_ds, order, b, "eval_dataset"),
            ev.prefetch_size,
            ev.num_parallel_workers,
            limit=n,
        )
        try:
            for b in range(n):
                yield to_device(ahead.get(b), self.env.device)
        finally:
            ahead.close()

    def close(self) -> None:
        """Stop the prefetching threads (optional: they also end with the process)."""
        self._train_ahead.close()

    # ---- resume -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"data": ...}, JSON-serialisable, for trainer_state.json (one key, so it merges into the trainer's state).
        The position is the step (the trainer's), so this only identifies the training data (format, order, the
        dataset's own state: data/protocol.py), for `load_state_dict` to refuse a resume on other data."""
        if self._state is None:
            dl = self.cfg.train_dataset.data_loader
            self._state = {"data": {"type": dl.type, "shuffle": self.shuffle, "dataset": self.train_ds.state_dict()}}
        return self._state

    def load_state_dict(self, state: dict) -> None:
        """`state` holds what `state_dict` returned (the whole trainer state will do). Raises UserError when the
        checkpoint was trained on other data; a checkpoint from before this state existed passes."""
        saved, now = state.get("data", {}), self.state_dict()["data"]
        check_same_data({k: v for k, v in saved.items() if k != "dataset"}, now, "train_dataset.data_loader")
        if "dataset" in saved:
            if hasattr(self.train_ds, "load_state_dict"):
                self.train_ds.load_state_dict(saved["dataset"])
            else:
                check_same_data(saved["dataset"], now["dataset"], "train_dataset")


def eval_data_loader(cfg: MeshformerConfig) -> tuple[bool, DataLoaderConfig]:
    """(whether eval_dataset names data of its own, the data_loader validation reads): without a location (or a
    format) of its own, validation reads the training data's other split."""
    dl, ev = cfg.train_dataset.data_loader, cfg.eval_dataset.data_loader
    own = _names_data(ev) or ev.type not in (dl.type, DataLoaderConfig.type)
    return own, ev if own else dataclasses.replace(dl, packing=ev.packing)


def check_own_validation(own: bool, eval_ds, train_dl: DataLoaderConfig) -> None:
    """Refuse validation that would read the training samples: eval_dataset names no data of its own (`own` from
    eval_data_loader) and the training data's format has no validation split (MindRecord files)."""
    if not own and not getattr(eval_ds, "has_splits", True):
        raise UserError(
            f"eval_dataset.data_loader: the training data ({train_dl.type} files) has no validation split, so "
            f"validation would read the training samples: give eval_dataset.data_loader.dataset_dir (or "
            f"dataset_files) files of its own, or set do_eval: false"
        )


def _names_data(dl: DataLoaderConfig) -> bool:
    """Whether a data_loader section says where its data is (else an eval section reuses the training data's)."""
    return bool(dl.dataset_dir or dl.dataset_files or dl.sizes or dl.config != DataLoaderConfig().config)


def configured_tokenizer(value: str, field: str, model_vocab_size: int) -> Path:
    """The tokenizer.json a config names (the file, or a folder holding it), checked to load and to fit the model."""
    p = Path(value)
    if p.is_file() and p.suffix != ".json":
        raise UserError(
            f"{field}={value!r} is not a tokenizer.json: meshformer reads Hugging Face tokenizer.json files "
            f"(convert a SentencePiece model with transformers and save_pretrained), or name a folder holding one"
        )
    tok = p / "tokenizer.json" if p.is_dir() else p
    n = vocab_size(load_tokenizer(value, field))  # one line if missing or not a tokenizer
    if n > model_vocab_size:
        raise UserError(
            f"model.model_config.vocab_size={model_vocab_size} is smaller than the vocabulary of {field}={value!r} "
            f"({n}): set vocab_size >= {n}"
        )
    return tok
