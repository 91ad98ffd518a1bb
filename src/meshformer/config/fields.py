"""The pieces every config section is made of: `setting` (a field with its one-line doc, bounds, choices and
MindSpore aliases, read by config/load.py and `meshformer config explain`), the dtype names, and choices that a
registry outside config/ fills."""

from __future__ import annotations

from dataclasses import MISSING, field, fields
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


def provenance(default: Any, doc: str) -> Any:
    """A field the loader fills about where the config came from: no setting (not read from YAML or the command
    line, not listed by `config explain`, not saved with a checkpoint's config.yaml)."""
    return field(default=default, init=False, repr=False, compare=False, metadata={"doc": doc, "provenance": True})


def schema_fields(cls: type) -> tuple:
    """A config class's settings: its dataclass fields less the `provenance` ones."""
    return tuple(f for f in fields(cls) if not f.metadata.get("provenance"))


class ModelConfigClasses:
    """`model_config.type` -> the config class of the family that builds it. The models fill it (models/registry.py:
    the built-in families' classes when `meshformer.models` is imported, others' as they register): the models
    import this schema, so the schema may not import them. Iterating gives the names (the `type` field's choices).
    Asking for a class while nothing is registered is a programming error, never a silent pass: every entry point
    (the CLI, the trainer, the planner, the tests' conftest) imports the models before it loads a config
    (docs/design.md, Config classes)."""

    def __init__(self) -> None:
        self._classes: dict[str, type] = {}

    def add(self, name: str, cls: type) -> None:
        self._classes[name] = cls

    def discard(self, names) -> None:
        for n in names:
            self._classes.pop(n, None)

    def class_of(self, name: str) -> type | None:
        """The config class of type `name`, or None for a name no family builds."""
        self.require()
        return self._classes.get(name)

    def items(self) -> list[tuple[str, type]]:
        self.require()
        return list(self._classes.items())

    def require(self) -> None:
        if not self._classes:
            raise RuntimeError(
                "no model family is registered: import meshformer.models before loading or checking a model config"
            )

    def __iter__(self):
        return iter(list(self._classes))

    def __contains__(self, value) -> bool:
        return value in self._classes

    def __len__(self) -> int:
        return len(self._classes)

    def __repr__(self) -> str:
        return repr(tuple(self._classes))


MODEL_CONFIGS = ModelConfigClasses()  # model_config.type's choices and classes (filled by models/registry.py)


class RegisteredDatasetFormats:
    """`data_loader.type`'s choices: the built-in dataset formats and those registered when the value is checked
    (data/formats.py, read without importing the openers; a format registered at run time is accepted). Imported
    when first checked: the data modules import no config, so this is a dependency one way, not a cycle."""

    def _names(self) -> list[str]:
        from meshformer.data.formats import dataset_formats  # no torch: the openers stay unimported

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
