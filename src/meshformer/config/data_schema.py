"""The data sections: where a dataset's tokens come from (`train_dataset`, `eval_dataset`) and its tokenizer
(`processor`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshformer.config.fields import RegisteredDatasetFormats, setting


@dataclass
class MegatronBlendConfig:
    """`data_loader.config` of a BlendedMegatronDatasetDataLoader: MindSpore Transformers' GPTDataset settings, read as
    Megatron-LM's GPTDatasetConfig reads them (data/megatron/)."""

    seed: int = setting(
        1234,
        "Random seed of Megatron's document and sample shuffles (its random_seed; 0 to 2**32 - 1).",
        ge=0,
        le=2**32 - 1,
    )
    seq_length: int | None = setting(
        None, "Tokens per sample (default: model.model_config.seq_length, which it must equal).", gt=0
    )
    split: str | None = setting(
        None,
        'Shares of every dataset for train, validation and test, e.g. "99,1,0" or "1, 0, 0" (Megatron\'s split; '
        "required with data_path).",
    )
    data_path: list = setting(
        [],
        "Weights and path prefixes in turn, e.g. ['0.3', /data/a_text_document, '0.7', /data/b_text_document] "
        "(a prefix alone: one dataset); weights are normalised as Megatron does.",
    )
    train_data_path: list = setting([], "Blend for the training split only (instead of data_path and split).")
    valid_data_path: list = setting([], "Blend for the validation split only (instead of data_path and split).")
    test_data_path: list = setting([], "Blend for the test split only (accepted; meshformer does not test).")
    num_dataset_builder_threads: int = setting(1, "Threads building the datasets' indices.", gt=0)
    path_to_cache: str | None = setting(
        None, "Accepted: the indices are rebuilt in memory (seconds for millions of documents); nothing is written."
    )
    mmap_bin_files: bool | None = setting(None, "Accepted: the .bin files are always memory-mapped, never copied.")
    reset_position_ids: bool = setting(False, "Rotary positions restart after every eod token.")
    reset_attention_mask: bool = setting(False, "Attention stops at every eod token (documents do not see each other).")
    eod_mask_loss: bool = setting(False, "The eod tokens are not targets of the loss.")
    create_attention_mask: bool = setting(
        True, "Accepted: meshformer builds the causal (and document) mask inside attention."
    )
    create_compressed_eod_mask: bool = setting(
        False, "Accepted: with reset_attention_mask the documents are passed to attention instead."
    )
    eod_pad_length: int = setting(128, "Accepted with create_compressed_eod_mask (no effect in meshformer).", gt=0)
    s3_cache_path: str | None = setting(None, "Accepted only when empty: meshformer reads local files.")
    drop_last_partial_validation_sequence: bool = setting(
        True, "Megatron's rule for the last, shorter validation sample: drop it (true) or pad it."
    )
    add_extra_token_to_sequence: bool = setting(
        True, "Samples of seq_length + 1 tokens (inputs and shifted labels), as Megatron reads them."
    )
    eod: int = setting(-1, "End-of-document token id in the data (-1: none; required by eod_mask_loss and reset_*).")
    pad: int = setting(-1, "Padding token id in the data (-1: none; padded targets are not counted).")


@dataclass
class DataLoaderConfig:
    type: str = setting(
        "MindDataset",
        "Dataset format: MindDataset (a `meshformer preprocess` directory, or MindRecord files), "
        "BlendedMegatronDatasetDataLoader (Megatron .bin/.idx blends), or one registered in data/registry.py.",
        choices=RegisteredDatasetFormats(),
    )
    dataset_dir: str = setting(
        "", "Directory written by `meshformer preprocess`, or holding .mindrecord files (MindDataset)."
    )
    dataset_files: list = setting([], "MindDataset: the .mindrecord files to read, in order (instead of dataset_dir).")
    datasets_type: str = setting(
        "GPTDataset", "BlendedMegatronDatasetDataLoader: the Megatron dataset class.", choices=("GPTDataset",)
    )
    sizes: list = setting(
        [],
        "BlendedMegatronDatasetDataLoader: samples to build for train, validation and test, e.g. [1000, 0, 0] "
        "(default: one epoch of the training split).",
    )
    config: MegatronBlendConfig = setting(
        MegatronBlendConfig, "BlendedMegatronDatasetDataLoader: the GPTDataset settings."
    )
    tokenizer: str = setting(
        "",
        "The data's tokenizer.json, or a folder holding it (default: processor.tokenizer, else the dataset's "
        "own); saved with every checkpoint. eval_dataset's, if set, must be the same.",
    )
    shuffle: bool | None = setting(
        None,
        "Shuffle sample order each epoch, derived from seed, so resumable (default: true, except for formats "
        "whose samples come in their own order, such as Megatron blends).",
    )
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
