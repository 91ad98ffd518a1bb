"""The pieces every config section is made of: `setting` (a field with its one-line doc, bounds, choices and
MindSpore aliases, read by config/load.py and `meshformer config explain`), the dtype names, and choices that a
registry outside config/ fills."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def setting(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A schema field: default, one-line doc, and the value checks the loader applies."""
    meta = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "aliases": aliases}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    if isinstance(default, type) and hasattr(default, "__dataclass_fields__"):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


class RegisteredNames:
    """Choices that a registry outside config/ fills as it registers names (models/registry.py adds each model
    family's config types): the models import this schema, so the schema may not import them. While nothing is
    registered (meshformer.models not imported yet) the loader has no list to check against and the registry's own
    lookup (`family_of`) refuses an unknown name instead, in the same words; the CLI imports the models first."""

    def __init__(self) -> None:
        self._names: list[str] = []

    def add(self, names) -> None:
        self._names.extend(n for n in names if n not in self._names)

    def discard(self, names) -> None:
        self._names = [n for n in self._names if n not in names]

    def __iter__(self):
        return iter(list(self._names))

    def __contains__(self, value) -> bool:
        return value in self._names

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return repr(tuple(self._names))


MODEL_TYPES = RegisteredNames()  # model_config.type's choices (models/registry.py register_family)
MOE_MODEL_TYPES = RegisteredNames()  # the types whose family builds routed experts (ModelFamily.moe)
LATENT_ATTENTION_TYPES = RegisteredNames()  # the types built with latent attention (ModelFamily.latent_attention)


class RegisteredDatasetFormats:
    """`data_loader.type`'s choices: the dataset formats registered when the value is checked (data/registry.py; a
    format registered at run time is accepted). Imported when first checked: the data modules import no config,
    so this is a dependency one way, not a cycle."""

    def _names(self) -> list[str]:
        from meshformer.data.registry import dataset_formats

        return dataset_formats()

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, value) -> bool:
        return value in self._names()

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(tuple(self._names()))


def is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "__dataclass_fields__")


def field_default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory()
