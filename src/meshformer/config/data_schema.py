"""The data sections: where a dataset's tokens come from (`train_dataset`, `eval_dataset`) and its tokenizer
(`processor`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import RegisteredDatasetFormats, setting


@dataclass
class DataLoaderConfig:
    type: str = setting(
        "MindDataset",
        "Dataset format: MindDataset (a `meshformer preprocess` directory) or any name registered with "
        "data/registry.py register_dataset_format.",
        choices=RegisteredDatasetFormats(),
    )
    dataset_dir: str = setting("", "Directory written by `meshformer preprocess`.")
    tokenizer: str = setting(
        "",
        "The data's tokenizer.json, or a folder holding it (default: processor.tokenizer, else the dataset's "
        "own); saved with every checkpoint. eval_dataset's, if set, must be the same.",
    )
    shuffle: bool = setting(True, "Shuffle sample order each epoch (the order is derived from seed, so resumable).")
    packing: bool = setting(
        False,
        "Instruction data: pack several samples per row, attention and rotary positions restarting at each "
        "(document masking); false pads one sample per row.",
    )


@dataclass
class DatasetConfig:
    data_loader: DataLoaderConfig = setting(DataLoaderConfig, "Where the tokens come from.")
    batch_size: int | None = setting(
        None,
        "Micro-batch size: samples per forward pass on each data-parallel rank (train_dataset default: "
        "runner_config.batch_size, else 1; eval_dataset default: the training micro-batch).",
        gt=0,
    )
    drop_remainder: bool = setting(
        True,
        "MindSpore batching flag (accepted; training always drops an epoch's incomplete "
        "last global batch, evaluation reads whole micro-batches).",
    )
    split: str | None = setting(
        None,
        "Split of the dataset directory to read (default: train for train_dataset, validation for eval_dataset).",
        choices=("train", "validation"),
    )
    num_parallel_workers: int = setting(
        1,
        "Threads building the next prefetch_size batches in the background (batches are a pure function of "
        "the step: samples and order do not change).",
        gt=0,
    )
    prefetch_size: int = setting(
        1,
        "Batches built ahead of their step (0: on the main thread when the step starts); on a GPU they wait "
        "in pinned memory and copy without blocking.",
        ge=0,
    )


@dataclass
class TokenizerConfig:
    tokenizer_file: str = setting(
        "", "Hugging Face tokenizer.json the data was made with (a folder holding one also works)."
    )
    vocab_file: str = setting(
        "",
        "MindSpore's name for it, read like tokenizer_file: a tokenizer.json or its folder (convert a "
        "SentencePiece .model or vocab.json + merges.txt first).",
    )


@dataclass
class ProcessorConfig:
    tokenizer: TokenizerConfig = setting(
        TokenizerConfig,
        "The training data's tokenizer when train_dataset.data_loader.tokenizer is not set (special tokens "
        "come from the file itself).",
    )
