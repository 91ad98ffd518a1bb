"""`meshformer config explain [PREFIX]` and `meshformer config check CONFIG`: the schema as help text."""

from __future__ import annotations

import typing

from meshformer.config.fields import schema_fields
from meshformer.config.schema import (
    LIST_ITEM_SCHEMAS,
    MeshformerConfig,
    ModelConfig,
    field_default,
    is_dataclass_type,
)


def iter_fields(cls=MeshformerConfig, prefix: str = ""):
    """(dotted name, type text, default, doc, choices) for every leaf field, depth first; under the model config,
    the fields every family has, then each type's own (its family's config class)."""
    hints = typing.get_type_hints(cls)
    for f in schema_fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        if is_dataclass_type(tp):
            yield name, "section", None, f.metadata["doc"], None
            yield from iter_fields(tp, name + ".")
            if tp is ModelConfig:
                yield from _family_fields(name)
            continue
        yield name, _type_text(tp), field_default(f), f.metadata["doc"], f.metadata.get("choices")
        item = LIST_ITEM_SCHEMAS.get(tuple(name.split(".")))
        if item is not None:
            yield from iter_fields(item, name + "[].")


def _family_fields(name: str):
    """Each family's own fields: those of its config classes that the base has not, or has otherwise (another
    default, doc or choices), under the family's types; a default that differs between its types names each."""
    from meshformer.models.registry import family_config_classes  # the config classes only: no torch imported

    common = {row[0]: row for row in iter_fields(ModelConfig, name + ".")}
    for family, config_types in family_config_classes().items():
        rows: dict[str, list] = {}
        for type_name, cls in config_types.items():
            for row in iter_fields(cls, name + "."):
                if row[0] != f"{name}.type" and row[1] != "section" and common.get(row[0]) != row:
                    rows.setdefault(row[0], []).append((type_name, row))
        types = ", ".join(config_types)
        yield f"{name} ({types})", "section", None, f"The {family} family's own fields (its config classes).", None
        for per_type in rows.values():
            field, tp, default, doc, choices = per_type[0][1]
            defaults = {t: row[2] for t, row in per_type}
            if len({repr(d) for d in defaults.values()}) > 1:
                default = _PerType(defaults)
            yield field, tp, default, doc, choices


class _PerType:
    """A default that depends on the type: printed as `TypeA: False, TypeB: True`."""

    def __init__(self, defaults: dict) -> None:
        self.defaults = defaults

    def __repr__(self) -> str:
        return ", ".join(f"{t}: {d!r}" for t, d in self.defaults.items())


def _type_text(tp) -> str:
    args = typing.get_args(tp)
    names = [getattr(a, "__name__", str(a)) for a in (args or (tp,))]
    return " | ".join("null" if n == "NoneType" else n for n in names)


def explain_text(prefix: str = "") -> str:
    lines = []
    for name, tp, default, doc, choices in iter_fields():
        if prefix and not name.startswith(prefix):
            continue
        if tp == "section":
            lines.append(f"\n{name}:  {doc}")
            continue
        extra = f" One of: {', '.join(map(str, choices))}." if choices else ""
        lines.append(f"  {name} ({tp}, default {default!r}): {doc}{extra}")
    return "\n".join(lines).lstrip("\n")


def markdown() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from `src/meshformer/config/schema.py` by `meshformer config explain --markdown`; a test keeps",
        "it in sync. Field names follow MindSpore Transformers. Override any field on the command line with",
        "`--dotted.name VALUE`.",
        "",
        "A config file is at most 1 MiB, nests at most 64 levels, and expands to at most 100,000 values with its",
        'YAML aliases followed (nested anchors, a "billion laughs", are refused at load, in one line: a config is',
        "not data). Every number is checked against the range torch accepts (AdamW's betas in [0, 1), a learning",
        "rate above 0, ...): an error names the field and its range.",
        "",
    ]
    for name, tp, default, doc, choices in iter_fields():
        if tp == "section":
            out += ["", f"## `{name}`", "", doc, "", "| field | type | default | meaning |", "|---|---|---|---|"]
            continue
        extra = f" One of: {', '.join(f'`{c}`' for c in choices)}." if choices else ""
        out.append(f"| `{name}` | {tp} | `{default!r}` | {doc}{extra} |")
    return "\n".join(out) + "\n"


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser(
        "config",
        help="explain every config field, or check a config file",
        description="Explain the config schema (every field with its type, default and meaning).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show_help = p.format_help

    def format_help() -> str:  # the field list needs every family's config class: built only when help is asked
        p.epilog = "fields:\n" + explain_text()
        return show_help()

    p.format_help = format_help
    verbs = p.add_subparsers(dest="verb", metavar="VERB")
    e = verbs.add_parser("explain", help="print every field (or those under PREFIX) with its doc")
    e.add_argument("prefix", nargs="?", default="", help="only fields starting with this, e.g. parallel_config")
    e.add_argument("--markdown", action="store_true", help="print docs/config.md")
    c = verbs.add_parser("check", help="load and validate a config (with overrides) and print it resolved")
    c.add_argument("config")
    c.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="also check the layout against this many processes (default: the config's own product)",
    )
    c.set_defaults(accepts_overrides=True)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.verb == "check":
        import yaml

        from meshformer.config.load import load_config, print_notices, to_dict
        from meshformer.config.validate import validate_run
        from meshformer.errors import UserError
        from meshformer.interop.base_model import BASE_MODEL_SOURCES
        from meshformer.train.finetune import apply_finetune_base

        if args.world_size is not None and args.world_size < 1:
            raise UserError(
                f"--world-size {args.world_size}: give the number of processes (at least 1), or leave it out"
            )
        notices: list[str] = []
        cfg = load_config(args.config, args.overrides, notices=notices)
        notices += apply_finetune_base(
            cfg, BASE_MODEL_SOURCES
        )  # a fine-tune's model is load_checkpoint's: its shape, then the layout
        validate_run(cfg, args.world_size)
        print_notices(notices)
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    if args.verb == "explain" and args.markdown:
        print(markdown(), end="")
        return 0
    prefix = getattr(args, "prefix", "")
    text = explain_text(prefix)
    if not text:
        import difflib

        from meshformer.errors import UserError

        names = [name for name, *_ in iter_fields()]
        guess = difflib.get_close_matches(prefix, names, n=1, cutoff=0.5)
        hint = f"did you mean {guess[0]!r}?" if guess else "run `meshformer config explain` for every field"
        raise UserError(f"config explain: no field starts with {prefix!r}: {hint}")
    print(text)
    return 0
