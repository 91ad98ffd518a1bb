"""The table of dataset formats by `data_loader.type`: what data/registry.py opens, filled by `register_dataset_format`.

Its own module so a format's module can register itself without importing the registry, which imports every
built-in format's module at its end (an import cycle otherwise). Everyone else uses data/registry.py, which
re-exports these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the protocol imports torch; the names below are read without it (`meshformer config explain`)
    from meshformer.data.protocol import Dataset

OpenFn = Callable[[Any, str, int, str], "Dataset"]
FORMATS: dict[str, OpenFn] = {}
# The formats meshformer ships, each registered by its own module when data/registry.py imports it; named here too so
# that `data_loader.type`'s choices are known without importing those modules (they import torch).
BUILTIN_FORMATS = ("BlendedMegatronDatasetDataLoader", "MindDataset", "PreferenceDataset")


def register_dataset_format(type_name: str, open_fn: OpenFn) -> None:
    """Make `data_loader.type: type_name` open datasets with `open_fn`; registering a name again replaces it."""
    FORMATS[type_name] = open_fn


def unregister_dataset_format(type_name: str) -> None:
    FORMATS.pop(type_name, None)


def dataset_formats() -> list[str]:
    """Every `data_loader.type` a dataset opens with: the built-in formats and those registered."""
    return sorted(set(BUILTIN_FORMATS) | set(FORMATS))
