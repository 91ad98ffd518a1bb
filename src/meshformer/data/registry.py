"""Dataset formats by `data_loader.type`: one opener per format, registered here or by any module at run time.

An opener is `open_fn(data_loader_cfg, split, seq_length, field) -> Dataset` (data/protocol.py): `field` is the
dotted name of the data_loader section, for its one-line errors (`f"{field}.dataset_dir"`). The trainer builds
batches from `sample(i)` alone, so a new format needs nothing else. The schema's `data_loader.type` accepts every
name registered when the config is read (config/schema.py RegisteredNames).
"""

from __future__ import annotations

import difflib

import torch

from meshformer.data.dataset import PREFERENCE_FORMAT, open_dataset, read_meta

# The table lives in data/formats.py, so a format's module registers itself without importing this one.
from meshformer.data.formats import FORMATS as _FORMATS
from meshformer.data.formats import (  # noqa: F401 (re-exported)
    OpenFn,
    dataset_formats,
    register_dataset_format,
    unregister_dataset_format,
)
from meshformer.data.protocol import Dataset
from meshformer.errors import UserError


def open_dataset_for(data_loader_cfg, split: str, seq_length: int, field: str) -> Dataset:
    """The `split` of the dataset `data_loader_cfg` describes, as samples of seq_length + 1 tokens."""
    open_fn = _FORMATS.get(data_loader_cfg.type)
    if open_fn is None:  # the config loader checks the name; a config built in code may not have been
        guess = difflib.get_close_matches(data_loader_cfg.type, list(_FORMATS), n=1)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        raise UserError(
            f"{field}.type={data_loader_cfg.type!r} is not a dataset format: {hint}choose one of "
            f"{', '.join(dataset_formats())}"
        )
    ds = open_fn(data_loader_cfg, split, seq_length, field)
    _check_first_sample(ds, data_loader_cfg.type, seq_length, field)
    return ds


def _check_first_sample(ds: Dataset, type_name: str, seq_length: int, field: str) -> None:
    """A format's samples have the protocol's shapes and dtypes: one line naming the format, not a stack error."""
    if len(ds) < 1:
        raise UserError(f"{field}: the {type_name} dataset has no samples: add data or lower seq_length")
    s, n = ds.sample(0), seq_length + 1
    for name, t, dtype in (("tokens", s.tokens, torch.int64), ("loss_mask", s.loss_mask, torch.bool)):
        if t is not None and (t.dtype != dtype or tuple(t.shape) != (n,)):
            raise UserError(
                f"{field}: {type_name} sample(0).{name} is {t.dtype} {list(t.shape)}, not {dtype} [{n}] "
                f"(seq_length + 1): the format's opener must cut samples to model.model_config.seq_length + 1"
            )
    for name in ("rejected", "rejected_mask"):
        t = getattr(s, name, None)
        dtype = torch.int64 if name == "rejected" else torch.bool
        if t is not None and (t.dtype != dtype or tuple(t.shape) != (n,)):
            raise UserError(f"{field}: {type_name} sample(0).{name} is {t.dtype} {list(t.shape)}, not {dtype} [{n}]")
    if s.documents is not None and (s.documents.dtype != torch.int64 or tuple(s.documents.shape) != (n,)):
        raise UserError(f"{field}: {type_name} sample(0).documents is not int64 [{n}]: fix the format's opener")


def _open_mind_dataset(dl, split: str, seq_length: int, field: str) -> Dataset:
    """meshformer's own directories (`meshformer preprocess`: packed text or instruction samples, a meta.json), else
    MindRecord files as MindSpore Transformers' MindDataset finds them (dataset_dir walked, or dataset_files). The
    MindRecord files have no splits: every split reads all their rows (eval_dataset names its own files)."""
    from meshformer.data import mindrecord  # imported at the bottom too; here for the names

    if dl.sizes or dl.config != type(dl.config)():  # a Megatron block under the wrong type would be ignored
        raise UserError(
            f"{field}.sizes/config are a Megatron blend's settings, read only with type: "
            f"BlendedMegatronDatasetDataLoader: set that type, or remove them for {dl.type}"
        )
    files = mindrecord.dataset_files(dl, field)
    if files is None:
        if read_meta(dl.dataset_dir, f"{field}.dataset_dir").get("format") == PREFERENCE_FORMAT:
            return _preference_dataset.open_preference(dl, split, seq_length, field)
        return open_dataset(dl.dataset_dir, split, seq_length, f"{field}.dataset_dir", dl.packing)
    if dl.packing:
        raise UserError(f"{field}.packing: MindRecord rows are read as written, one per sample: set packing: false")
    return mindrecord.open_mindrecord(files, seq_length, field)


register_dataset_format("MindDataset", _open_mind_dataset)

# Formats in their own modules register themselves when imported (through data/formats.py).
from meshformer.data import mindrecord as _mindrecord  # noqa: E402, F401
from meshformer.data import preference_dataset as _preference_dataset  # noqa: E402, F401
from meshformer.data.megatron import loader as _megatron_loader  # noqa: E402, F401
