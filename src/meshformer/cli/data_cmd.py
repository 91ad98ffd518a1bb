"""`meshformer data samples CONFIG [--start I] [--count N] [--json] [--split S]` and `meshformer data stats CONFIG`:
what the trainer will read, before a run (the seed article's "print a few samples and check the format").

`samples` prints the run's samples in training order (sample k of the run is position k % global_batch of global
batch k // global_batch, whose ids come from the same SampleOrder / GlobalBatches the trainer builds) with the
inputs, labels and loss mask the trainer computes from them (data/dataset.py batch_inputs), and, without --json,
the decoded text; a preference pair also shows its rejected sequence (rejected_tokens, rejected_labels,
rejected_loss_mask: the loss mask is the completion's) and a KTO example its label. `stats` prints the dataset's
size and what its format says of itself (documents, tokens, blend proportions, padding, preference pairs: the
format's `describe()`).
"""

from __future__ import annotations

import json

from meshformer.errors import UserError

# Sample k is in epoch k // samples_per_epoch, whose order is seeded with seed * 7919 + epoch (data/dataset.py
# SampleOrder): beyond 2**63 samples that seed would overflow the generator's 64 bits.
MAX_SAMPLES = 2**63


def add_parser(sub) -> None:
    p = sub.add_parser(
        "data",
        help="print the samples a config's training will read, or its dataset's statistics",
        description="Inspect the dataset a config names, as the trainer reads it.",
    )
    verbs = p.add_subparsers(dest="data_command", metavar="VERB", required=True)
    s = verbs.add_parser(
        "samples",
        help="the run's samples in training order: input ids, labels, loss mask (and text)",
        description="One sample per line: a JSON object with tokens (the input ids), labels (next-token targets, "
        "the ignore id where the loss does not count), loss_mask and, for rows of several documents, "
        "position_ids; without --json also the decoded text.",
    )
    _common(s)
    s.add_argument("--start", type=int, default=0, metavar="I", help="first sample of the run to print (default 0)")
    s.add_argument("--count", type=int, default=4, metavar="N", help="how many samples (default 4)")
    s.add_argument("--json", action="store_true", help="JSON objects only, one per line (no decoded text)")
    s.set_defaults(func=run_samples, accepts_overrides=True)
    t = verbs.add_parser(
        "stats",
        help="samples, tokens, documents, blend proportions and padding of a config's dataset",
        description="The dataset's size in samples and steps, and the statistics its format reports.",
    )
    _common(t)
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(func=run_stats, accepts_overrides=True)


def _common(p) -> None:
    p.add_argument("config", help="YAML config (dotted --section.field VALUE overrides may follow)")
    p.add_argument(
        "--split",
        default=None,
        choices=("train", "validation"),
        help="train_dataset's split (default) or the validation data the run evaluates on",
    )


class _View:
    """The dataset, order and labelling rules of one split of a config, without a process group."""

    def __init__(self, args):
        from meshformer.config.load import load_config
        from meshformer.data.dataset import GlobalBatches, SampleOrder
        from meshformer.data.protocol import check_tokenizer, shuffles
        from meshformer.data.registry import open_dataset_for
        from meshformer.parallel.batch_plan import BatchPlan
        from meshformer.parallel.dims import ParallelDims

        cfg = load_config(args.config, getattr(args, "overrides", []))
        self.cfg, self.mc = cfg, cfg.model.model_config
        pc = cfg.parallel_config
        dims = ParallelDims.from_config(cfg, pc.data_parallel * pc.model_parallel * pc.pipeline_stage)
        self.plan = BatchPlan.from_config(cfg, dims)
        train_dl = cfg.train_dataset.data_loader
        self.validation = args.split == "validation"
        if self.validation:
            from meshformer.train.data import eval_data_loader

            own, dl = eval_data_loader(cfg)  # what the trainer's validation reads
            split, section = cfg.eval_dataset.split or "validation", "eval_dataset"
        else:
            dl, split, section = train_dl, cfg.train_dataset.split or "train", "train_dataset"
        self.section, self.split, self.dl = section, split, dl
        self.ds = open_dataset_for(dl, split, self.mc.seq_length, f"{section}.data_loader")
        if self.validation:
            from meshformer.train.data import check_own_validation

            check_own_validation(own, self.ds, train_dl)
        # what the trainer checks (train/data.py): the data's vocabulary and token ids against the model's
        check_tokenizer(self.ds, None, self.mc.vocab_size, f"{section}.data_loader")
        self.shuffle = False if self.validation else shuffles(self.ds, dl.shuffle)
        self.global_batch = min(self.plan.global_batch, len(self.ds))
        self.batches = GlobalBatches(SampleOrder(len(self.ds), cfg.seed, self.shuffle), self.global_batch)

    def sample_id(self, k: int) -> int:
        b, pos = divmod(k, self.global_batch)
        return int(self.batches.sample_ids(b)[pos])

    def tokenizer(self):
        """The run's tokenizer (train/data.py's order of choice), or None when neither config nor data has one."""
        from meshformer.data.tokenizer import load_tokenizer

        pt = self.cfg.processor.tokenizer
        for value in (self.cfg.train_dataset.data_loader.tokenizer, pt.tokenizer_file, pt.vocab_file):
            if value:
                return load_tokenizer(value)
        f = self.ds.tokenizer_file
        return load_tokenizer(f) if f is not None and f.is_file() else None


def run_samples(args) -> int:
    from meshformer.data.protocol import Sample

    if args.start < 0 or args.count < 1 or args.start + args.count > MAX_SAMPLES:
        raise UserError(
            f"--start {args.start} --count {args.count}: the run's samples are numbered 0 to 2**63 - 1: give "
            f"--start >= 0, --count >= 1 and --start + --count <= 2**63"
        )
    view = _View(args)
    tok = None if args.json else view.tokenizer()
    ignore = view.mc.ignore_token_id
    for k in range(args.start, args.start + args.count):
        i = view.sample_id(k)
        sample = view.ds.sample(i)
        row = {"index": k, "sample": i, "step": k // view.global_batch + 1}
        row.update(_labelled(sample, view.mc.vocab_size, ignore, f"{view.section}: sample {i}"))
        if getattr(sample, "rejected", None) is not None:  # a preference pair: the rejected sequence beside it
            rejected = Sample(sample.rejected, sample.rejected_mask)
            rest = _labelled(rejected, view.mc.vocab_size, ignore, f"{view.section}: sample {i}")
            row.update({f"rejected_{key}": value for key, value in rest.items()})
        if getattr(sample, "label", None) is not None:
            row["label"] = sample.label
        print(json.dumps(row))
        if tok is not None:
            for key in ("tokens", "rejected_tokens"):
                if key in row:
                    what = "sample" if key == "tokens" else "rejected sequence of sample"
                    print(f"# text of {what} {i}: {json.dumps(tok.decode(row[key], skip_special_tokens=False))}")
    return 0


def _labelled(sample, vocab_size: int, ignore: int, where: str) -> dict:
    """tokens, labels, loss_mask (and position_ids for a packed row) of one sample as the trainer computes them."""
    from meshformer.data.dataset import batch_inputs

    inputs, labels, documents = batch_inputs([sample], vocab_size, ignore, where)
    row = {
        "tokens": inputs[0].tolist(),
        "labels": labels[0].tolist(),
        "loss_mask": (labels[0] != ignore).int().tolist(),
    }
    if documents is not None:
        row["position_ids"] = _positions(documents[0].tolist())
    return row


def _positions(documents: list[int]) -> list[int]:
    """Rotary positions restarting at each document, as the model computes them from the documents."""
    out, prev, pos = [], None, 0
    for d in documents:
        pos = 0 if d != prev else pos + 1
        out.append(pos)
        prev = d
    return out


def run_stats(args) -> int:
    view = _View(args)
    n = len(view.ds)
    stats = {
        "type": view.dl.type,
        "split": view.split,
        "samples": n,
        "tokens_per_sample": view.mc.seq_length + 1,
        "global_batch": view.plan.global_batch,
        "steps_per_epoch": n // view.plan.global_batch,
        "shuffle": view.shuffle,
    }
    describe = getattr(view.ds, "describe", None)
    if describe is not None:
        stats.update(describe())
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    width = max(map(len, stats))
    for key, value in stats.items():
        shown = json.dumps(value) if isinstance(value, (dict, list)) else value
        print(f"{key:<{width}}  {shown}")
    return 0
