"""`meshformer train CONFIG [--section.field VALUE ...]` (also under torchrun: `torchrun ... -m meshformer train`)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train (pre-train or fine-tune) from a YAML config",
        description="Train from a YAML config. Any field can be overridden with --section.field VALUE, "
        "e.g. --parallel_config.data_parallel 2 --model.model_config.num_layers 2.",
    )
    p.add_argument("config", help="YAML config file (MindSpore Transformers field names)")
    p.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    from meshformer.config.load import load_config
    from meshformer.train.preemption import die_with_parent
    from meshformer.train.trainer import run_training

    die_with_parent()  # under torchrun: a killed launcher takes its workers with it
    notices: list[str] = []
    cfg = load_config(args.config, args.overrides, notices=notices)
    run_training(cfg, notices)
    return 0
