"""A family is its folder: no file outside a family folder and the registry names a family, its config types, its
own fields or its attention classes."""

from __future__ import annotations

import re

from conftest import ROOT
from test_structure import module_name

SRC = ROOT / "src"


# Names of family-specific knowledge outside the families (each family owns its config and answers for itself).
RETIRED = {"uses_mla", "MOE_MODEL_TYPES", "LATENT_ATTENTION_TYPES", "MODEL_TYPES", "FAMILY_DEFAULTS"}
# (file under src/meshformer, name) pairs allowed to stay, each with its reason.
ALLOWED = {("config/model_schema.py", "LlamaConfig")}  # the default `model_config.type`, as MindSpore's


def _family_names() -> dict[str, set[str]]:
    """Family package (meshformer.models.<folder>) -> the names only it may use: its config types and config classes
    (and the sections' classes they own), the fields and properties those classes add to the common base, its
    attention classes (those context parallelism installs on) with a distinctive name."""
    import dataclasses
    import typing

    from meshformer.config.model_schema import ModelConfig
    from meshformer.models.registry import families

    base_names = set(dir(ModelConfig))
    base_hints = typing.get_type_hints(ModelConfig)
    out: dict[str, set[str]] = {}
    for family in families():
        package = family.build.__module__.rpartition(".")[0]
        if not package.startswith("meshformer.models."):
            continue  # a family registered by a test
        names = out.setdefault(package, set(family.config_types))
        for cls in family.config_types.values():
            for owner in cls.__mro__:
                if not owner.__module__.startswith(package + "."):
                    continue
                names.add(owner.__name__)
                names.update(n for n in vars(owner) if not n.startswith("_") and n not in base_names)
            for f in dataclasses.fields(cls):  # a section whose class the family owns: its new fields
                section = typing.get_type_hints(cls)[f.name]
                if f.name in base_hints and section is not base_hints[f.name] and dataclasses.is_dataclass(section):
                    names.add(section.__name__)
                    names.update({g.name for g in dataclasses.fields(section)} - set(dir(base_hints[f.name])))
        names.update(c.__name__ for c in family.cp_attention if sum(ch.isupper() for ch in c.__name__) > 1)
    return out


def test_no_file_outside_a_family_folder_names_the_family_its_attention_or_its_fields():
    """Whatever varies by family is asked of the family (models/registry.py ModelFamily): no file outside the
    family folders (`models/<family>/`), the registry and `models/__init__.py` (the imports that register them)
    imports a family's folder or names its config types, config classes, own config fields or attention classes,
    nor flags that branch on families."""
    owned = _family_names()
    assert {"kv_lora_rank", "LatentAttention", "Qwen2Config", "DeepseekConfig", "beta_fast"} <= set().union(
        *owned.values()
    )
    offences = []
    for path in sorted((SRC / "meshformer").rglob("*.py")):
        rel = path.relative_to(SRC / "meshformer").as_posix()
        module = module_name(path)
        text = path.read_text(encoding="utf-8")
        if rel in ("models/registry.py", "models/__init__.py") or any(  # the registry, the import that registers
            module == p or module.startswith(p + ".") for p in owned
        ):  # a family folder may build on another's modules (DeepSeek on Llama's)
            continue
        for package, names in owned.items():
            for name in sorted(names | RETIRED) + [package]:
                if (rel, name) not in ALLOWED and re.search(rf"(?<![\w.]){re.escape(name)}\b", text):
                    offences.append(f"{rel}: {name}")
    assert not offences, "a family's names outside its folder: " + ", ".join(sorted(set(offences)))
