"""YAML file + dotted command-line overrides -> a typed, checked `MeshformerConfig`.

Values are read with `yaml.safe_load` only. Each key is checked against the schema: unknown keys get a
did-you-mean, values get type and range checks, MindSpore-only keys are accepted with a notice.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from meshformer.config.fields import MODEL_CONFIGS, schema_fields
from meshformer.config.mindspore_keys import IGNORED_KEYS, MODEL_CHANGING_KEYS
from meshformer.config.schema import (
    LIST_ITEM_SCHEMAS,
    MeshformerConfig,
    ModelConfig,
    field_default,
    is_dataclass_type,
)
from meshformer.config.yaml_text import load_yaml_text, read_yaml
from meshformer.errors import UserError

# Misspellings seen in the wild that we accept silently (the seed article itself writes CheckpointMointor).
VALUE_ALIASES = {"CheckpointMointor": "CheckpointMonitor"}


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`--a.b.c VALUE` / `--a.b.c=VALUE` pairs -> [(dotted_key, yaml-typed value)]."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) == 2:
            raise UserError(f"unexpected argument {a!r}: overrides look like --section.field VALUE")
        key = a[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
        else:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or (nxt.startswith("--") and len(nxt) > 2):  # never swallow the next flag as a value
                raise UserError(f"override --{key} has no value: write --{key} VALUE (or --{key}=VALUE)")
            raw = nxt
            i += 1
        i += 1
        try:
            value = load_yaml_text(raw, f"override --{key}") if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out


def apply_override(data: dict, dotted: str, value: Any) -> None:
    """Set data[a][b][c] = value for "a.b.c", creating sections; list items are addressed by index or type."""
    parts = dotted.split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = _list_item(node, part, ".".join(parts[: depth + 1]))
            continue
        nxt = node.get(part)
        if nxt is None:  # a section the file leaves out starts from its schema default (callbacks is a list)
            nxt = node[part] = _default_section(parts[: depth + 1]) if node is data else {}
        if not isinstance(nxt, (dict, list)):
            raise UserError(f"override --{dotted}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        node = nxt
    if isinstance(node, list):
        raise UserError(f"override --{dotted}: address a list item's field, e.g. --callbacks.0.per_print_times 5")
    node[parts[-1]] = value
    # The file may spell the same field by an alias (train_steps for stop_step): the override replaces it.
    for other in _spellings(parts) - {parts[-1]}:
        node.pop(other, None)


def _spellings(parts: list[str]) -> set[str]:
    """Every name (field and aliases) of the schema field at the dotted path, or {} when it is not one."""
    cls: Any = MeshformerConfig
    for depth, part in enumerate(parts):
        if cls is None:
            return set()
        if part.isdigit() or not is_dataclass_type(cls):  # a list item: its schema, if it has one
            cls = LIST_ITEM_SCHEMAS.get(tuple(parts[:depth]))
            continue
        fields = {f.name: f for f in schema_fields(cls)}
        name = next((n for n, f in fields.items() if part == n or part in f.metadata.get("aliases", ())), None)
        if name is None:
            return set()
        if depth == len(parts) - 1:
            return {name, *fields[name].metadata.get("aliases", ())}
        tp = typing.get_type_hints(cls)[name]
        cls = tp if is_dataclass_type(tp) else LIST_ITEM_SCHEMAS.get(tuple(parts[: depth + 1]))
    return set()


def _default_section(path: list[str]) -> dict | list:
    """The schema default of a top-level list field (a copy), else an empty mapping."""
    f = {f.name: f for f in schema_fields(MeshformerConfig)}.get(path[0]) if len(path) == 1 else None
    default = field_default(f) if f is not None else None
    return copy.deepcopy(default) if isinstance(default, list) else {}


def _list_item(items: list, part: str, where: str) -> dict:
    if part.isdigit() and int(part) < len(items):
        return items[int(part)]
    for it in items:  # callbacks.CheckpointMonitor.save_checkpoint_steps
        if isinstance(it, dict) and VALUE_ALIASES.get(it.get("type"), it.get("type")) == part:
            return it
    raise UserError(f"override: no item {part!r} in {where}; use an index (0..{len(items) - 1}) or an item's type")


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, *, notices: list[str] | None = None
) -> MeshformerConfig:
    data = read_yaml(path) if path is not None else {}
    for key, value in parse_overrides(overrides or []):
        apply_override(data, key, value)
    _place_moe_config(data)
    cfg = from_dict(MeshformerConfig, data, (), notices if notices is not None else [])
    # Which model fields the file or the command line set (run_mode: finetune fills the others from the base model).
    given = ((data.get("model") or {}).get("model_config") or {}) if isinstance(data.get("model"), dict) else {}
    inner = given.get("moe_config") if isinstance(given, dict) else None
    cfg.model_fields_given = frozenset(given) | {f"moe_config.{k}" for k in (inner if isinstance(inner, dict) else ())}
    from meshformer.config.validate import validate_config

    if cfg.run_mode == "finetune" and cfg.load_checkpoint:
        # The model is load_checkpoint's: train/finetune.py (apply_finetune_base) takes its shape, then validates.
        # Validated now, the model would be the schema's default dense one (an MoE's expert_parallel refused).
        return cfg
    validate_config(cfg)
    return cfg


def _place_moe_config(data: dict) -> None:
    """MindSpore Transformers writes `moe_config` at the top level; it describes the model, so it moves under
    model.model_config (where the families read it). Both places at once must agree."""
    if not isinstance(data, dict) or "moe_config" not in data:
        return
    top = data.pop("moe_config")
    if top is None:
        return
    model = data.setdefault("model", {})
    mc = model.setdefault("model_config", {}) if isinstance(model, dict) else None
    if not isinstance(mc, dict):
        raise UserError("model.model_config must be a section to hold moe_config")
    inner = mc.get("moe_config")
    if inner is not None and inner != top:
        raise UserError(
            "moe_config is given at the top level and as model.model_config.moe_config with other values: keep one"
        )
    mc["moe_config"] = top


MODEL_PATH = ("model", "model_config")


def model_config_class(data: Any, path: tuple = MODEL_PATH) -> type:
    """The config class of the family that builds `data`'s `type` (the base's default type when it names none), from
    the classes the families registered (config/fields.py MODEL_CONFIGS; nothing registered is an error, not a
    pass). A dense type given a `moe_config` that asks for no experts (MindSpore files may carry one) drops it; one
    that asks for experts is refused naming the types that build them."""
    meta = {f.name: f for f in dataclasses.fields(ModelConfig)}["type"].metadata
    name = data.get("type", ModelConfig.type) if isinstance(data, dict) else ModelConfig.type
    MODEL_CONFIGS.require()
    _check_range(_dot(path, "type"), name, meta)
    cls = MODEL_CONFIGS.class_of(name)
    has_moe = "moe_config" in {f.name for f in dataclasses.fields(cls)}
    if isinstance(data, dict) and "moe_config" in data and not has_moe:
        owners = [c for _, c in MODEL_CONFIGS.items() if "moe_config" in {f.name for f in dataclasses.fields(c)}]
        moe_types = [t for t, c in MODEL_CONFIGS.items() if c in owners]
        experts = 1
        if owners and data["moe_config"] is not None:  # checked in the MoE schema's words first
            schema = typing.get_type_hints(owners[0])["moe_config"]
            experts = from_dict(schema, data["moe_config"], (*path, "moe_config"), []).expert_num
        if experts != 1:
            raise UserError(
                f"{_dot(path, 'moe_config')}.expert_num={experts} but {_dot(path, 'type')}={name} builds a "
                f"dense model: choose an MoE type ({', '.join(moe_types)}) or set expert_num: 1"
            )
        data.pop("moe_config")  # a dense model's MindSpore file may say so: it changes nothing
    return cls


def _elsewhere(path: tuple, key: str, value: Any = None, check_value: bool = False) -> dict[str, Any]:
    """{model type: its field} for the types whose config class has field `key` at `path` (under
    model.model_config), and, with `check_value`, allows `value` there: what a refusal names when a field belongs to
    another family."""
    if path[:2] != MODEL_PATH:
        return {}
    found = {}
    for name, cls in MODEL_CONFIGS.items():
        f = None
        for part in (*path[2:], key):
            fields = {f.name: f for f in dataclasses.fields(cls)} if is_dataclass_type(cls) else {}
            alias_of = {a: f.name for f in fields.values() for a in f.metadata.get("aliases", ())}
            f = fields.get(alias_of.get(part, part))
            if f is None:
                break
            cls = typing.get_type_hints(cls)[f.name]
        choices = f.metadata.get("choices") if f is not None else None
        if f is not None and (not check_value or (choices and value in choices)):
            found[name] = f
    return found


def _foreign_default(path: tuple, key: str, value: Any, data: dict, cls: type) -> bool:
    """True for a key no field of this type has but another family's has, at that field's default: a config.yaml
    written before each family owned its fields lists every family's fields at their defaults, which change
    nothing and are skipped, as they were ignored then. Such a key at another value is refused naming the types
    that have it; False for a key no family has."""
    owners = _elsewhere(path, key)
    if not owners:
        return False
    if any(not is_dataclass_type(f.type) and value == field_default(f) for f in owners.values()):
        return True
    mine = f", not {data['type'] if 'type' in data else cls.type}" if path == MODEL_PATH else ""
    raise UserError(
        f"{_dot(path, key)}={_show(value)}: a field of the types {', '.join(owners)}{mine}: choose one of them or "
        f"remove {key}"
    )


def from_dict(cls: type, data: Any, path: tuple, notices: list[str]) -> Any:
    where = ".".join(path) or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a section (a mapping of fields), got {_show(data)}")
    if cls is ModelConfig:  # the base: the family of `type` has the class with its own fields
        data = dict(data)
        cls = model_config_class(data, path)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in schema_fields(cls)}
    alias_of = {a: f.name for f in fields.values() for a in f.metadata.get("aliases", ())}
    ignored = IGNORED_KEYS.get(path, set())
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        name = alias_of.get(key, key)
        if name not in fields:
            if key in ignored:
                harmless, why = MODEL_CHANGING_KEYS.get((path, key), (None, ""))
                if harmless is not None and not harmless(value):
                    raise UserError(f"{_dot(path, key)}={_show(value)}: {why}")
                notices.append(f"{_dot(path, key)} is a MindSpore-only setting; meshformer ignores it")
                continue
            if _foreign_default(path, key, value, data, cls):
                continue
            guess = difflib.get_close_matches(key, list(fields) + list(alias_of), n=1, cutoff=0.6)
            hint = f"did you mean {_dot(path, guess[0])!r}?" if guess else f"valid fields: {', '.join(sorted(fields))}"
            raise UserError(f"unknown config key {_dot(path, key)!r}: {hint}")
        if name in kwargs:
            again = _convert(hints[name], value, path + (name,), fields[name].metadata, notices)
            if again == kwargs[name]:  # MindSpore files repeat a value under its alias (theta, rotary_emb_base)
                continue
            raise UserError(f"{_dot(path, key)}={value!r} contradicts {_dot(path, name)}={kwargs[name]!r}: keep one")
        kwargs[name] = _convert(hints[name], value, path + (name,), fields[name].metadata, notices)
    for name, f in fields.items():  # list defaults whose items have a schema are built like given values
        if name not in kwargs and path + (name,) in LIST_ITEM_SCHEMAS:
            kwargs[name] = _convert(hints[name], field_default(f), path + (name,), f.metadata, notices)
        elif name not in kwargs and is_dataclass_type(hints[name]):  # an absent section: its class's defaults (the
            kwargs[name] = from_dict(hints[name], {}, path + (name,), notices)  # model config's is its family's)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: tuple, meta: dict, notices: list[str]) -> Any:
    dotted = ".".join(path)
    if is_dataclass_type(tp):
        return from_dict(tp, value, path, notices)
    options = _union_members(tp)
    if value is None:
        if type(None) in options:
            return None
        raise UserError(f"{dotted} must not be empty: give a {_type_name(tp)} value")
    value = VALUE_ALIASES.get(value, value) if isinstance(value, str) else value
    converted = _coerce(options, value)
    if converted is _NO:
        raise UserError(f"{dotted} must be {_type_name(tp)}, got {_show(value)}: fix the value's type")
    if isinstance(converted, list) and path in LIST_ITEM_SCHEMAS:
        converted = [
            from_dict(LIST_ITEM_SCHEMAS[path], it, path + (str(i),), notices) for i, it in enumerate(converted)
        ]
    _check_range(dotted, converted, meta)
    return converted


_NO = object()


def _coerce(options: list, value: Any) -> Any:
    for opt in options:
        if opt is bool and isinstance(value, bool):
            return value
        if opt is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if opt is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if opt is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if opt is str and isinstance(value, str):
            return value
        if opt is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `--output_dir 2024` arrives YAML-typed as a number
        if opt is list and isinstance(value, list):
            return value
        if opt is dict and isinstance(value, dict):
            return value
    return _NO


def _check_range(dotted: str, v: Any, meta: dict) -> None:
    choices = meta.get("choices")
    if choices and v not in choices:
        *section, name = dotted.split(".")
        owners = _elsewhere(tuple(section), name, v, check_value=True)
        if owners:
            raise UserError(
                f"{dotted}={v} is built for the types {', '.join(owners)} only: choose one of them, or one of "
                f"{', '.join(map(str, choices))}"
            )
        guess = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        raise UserError(f"{dotted}={v!r} is not allowed: {hint}choose one of {', '.join(map(str, choices))}")
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return
    if isinstance(v, float) and not math.isfinite(v):
        raise UserError(f"{dotted}={v} is not a finite number: give a real value")
    for op, bound, ok in (
        ("ge", meta.get("ge"), lambda a, b: a >= b),
        ("gt", meta.get("gt"), lambda a, b: a > b),
        ("le", meta.get("le"), lambda a, b: a <= b),
        ("lt", meta.get("lt"), lambda a, b: a < b),
    ):
        if bound is not None and not ok(v, bound):
            rel = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[op]
            raise UserError(f"{dotted}={v} is out of range: it must be {rel} {bound}")


def _union_members(tp: Any) -> list:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return list(typing.get_args(tp))
    return [origin or tp]


def _type_name(tp: Any) -> str:
    names = {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "empty",
    }
    return " or ".join(names.get(typing.get_origin(o) or o, str(o)) for o in _union_members(tp))


def _show(v: Any) -> str:
    s = repr(v)
    return (s[:40] + "...") if len(s) > 43 else s


def _dot(path: tuple, key: str) -> str:
    return ".".join(path + (key,))


def to_dict(cfg: Any) -> dict:
    """The config's settings as plain values (what config.yaml holds): provenance fields left out."""
    values = dataclasses.asdict(cfg)
    return {f.name: values[f.name] for f in schema_fields(type(cfg))}


def print_notices(notices: list[str]) -> None:
    for n in notices:
        print(f"note: {n}", file=sys.stderr)
