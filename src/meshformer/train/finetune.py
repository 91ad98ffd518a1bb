"""`run_mode: finetune`: the model is the one `load_checkpoint` names, so a fine-tuning YAML needs no architecture.

The base model's `model_config` (a meshformer checkpoint's config.yaml, or a Hugging Face directory's
config.json) fills every shape field the run's config leaves out; a shape field the config does give must agree,
or one line says which differs. What belongs to the run stays the run's own: seq_length, dtypes, pet_config,
init and token-id settings. Only the weights come along (not the optimizer state or the step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import yaml

from meshformer.config.load import from_dict
from meshformer.config.model_schema import ModelConfig, RopeScalingConfig
from meshformer.config.schema import MeshformerConfig
from meshformer.config.validate import validate_config
from meshformer.config.yaml_text import load_yaml_text
from meshformer.errors import UserError
from meshformer.models.registry import family_of
from meshformer.train.base_source import BaseModelSource, source_of

# The fields every model config has that shape the network; a family adds its own (ModelFamily.shape_fields, e.g.
# its attention's widths, "moe_config.expert_num" for a field of a section).
SHAPE_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "n_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "theta",
    "rope_scaling",
    "tie_word_embeddings",
    "max_position_embedding",
)


def base_model_config(src: str, sources: Sequence[BaseModelSource] = ()) -> ModelConfig:
    """load_checkpoint's model config: a meshformer checkpoint's or run's, or that of a model one of `sources`
    claims (a Hugging Face directory: train/base_source.py)."""
    from meshformer.checkpoint.store import resolve_checkpoint

    p = Path(src)
    source = source_of(p, sources)
    if source is not None:
        fields = source.model_fields(p)
    else:
        ckpt = resolve_checkpoint(p)
        try:
            data = load_yaml_text((ckpt / "config.yaml").read_text(), f"{ckpt}/config.yaml")
            fields = data["model"]["model_config"]
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            raise UserError(f"load_checkpoint={src!r}: {ckpt}/config.yaml has no model.model_config") from None
    return from_dict(ModelConfig, fields, ("model", "model_config"), [])


def apply_finetune_base(cfg: MeshformerConfig, sources: Sequence[BaseModelSource] = ()) -> list[str]:
    """Fill the model shape from load_checkpoint (run_mode: finetune), then validate the whole config (load_config
    leaves a fine-tune's to this: its layout can only be checked against the real model); returns notices naming
    what was taken. Every command that uses a fine-tune's config calls it first, with the model sources it accepts
    besides meshformer checkpoints (the CLI: a Hugging Face directory, interop/base_model.py)."""
    if cfg.run_mode != "finetune":
        return []
    if not cfg.load_checkpoint:
        raise UserError("run_mode: finetune needs load_checkpoint (a checkpoint, run directory or Hugging Face model)")
    base = base_model_config(cfg.load_checkpoint, sources)
    given = cfg.model_fields_given
    mc = _as_class_of(cfg.model.model_config, base, given)
    cfg.model.model_config = mc
    taken = _take(mc, base, ("type", *SHAPE_FIELDS, *family_of(base).shape_fields), given)
    validate_config(cfg)
    return (
        [
            f"run_mode finetune: model shape from {cfg.load_checkpoint} ({mc.type}, {mc.num_layers} layers, hidden "
            f"{mc.hidden_size}, vocab {mc.vocab_size})"
        ]
        if taken
        else []
    )


def _as_class_of(mc: ModelConfig, base: ModelConfig, given) -> ModelConfig:
    """The run's model config as the base model's config class (a run that names no type was loaded as the default
    type's): the run's own values for every field both classes have, the class defaults for the rest (the shape
    fields among them are then taken from the base, as for any run). A field the run gives that the base's class
    has not is one line."""
    if type(mc) is type(base):
        return mc
    if "type" in given:
        _take(mc, base, ("type",), given)  # names both types
    ours = {f.name for f in dataclasses.fields(mc)}
    for name in sorted(given):
        top = name.split(".")[0]
        if top not in {f.name for f in dataclasses.fields(base)}:
            raise UserError(
                f"model.model_config.{name} is not a field of {base.type}, the model in load_checkpoint: remove it"
            )
    values = {f.name: getattr(mc, f.name) for f in dataclasses.fields(base) if f.name in ours}
    return type(base)(**{**values, "type": base.type})


def _take(ours_cfg, base_cfg, names, given) -> list[str]:
    """Copy each of `names` the run leaves out from the base (a dotted name: a field of a section); one line for a
    given one that differs."""
    taken = []
    for name in names:
        *section, leaf = name.split(".")
        ours_obj, base_obj = ours_cfg, base_cfg
        for part in section:
            ours_obj, base_obj = getattr(ours_obj, part), getattr(base_obj, part)
        theirs = getattr(base_obj, leaf)
        if name in given:
            ours = getattr(ours_obj, leaf)
            same = vars(ours) == vars(theirs) if isinstance(ours, RopeScalingConfig) else ours == theirs
            if not same:
                raise UserError(
                    f"model.model_config.{name}={_show(ours)} but the model in load_checkpoint has "
                    f"{_show(theirs)}: remove the field (run_mode: finetune takes the model's own) or fine-tune "
                    f"another model"
                )
        else:
            setattr(ours_obj, leaf, theirs)
            taken.append(name)
    return taken


def _show(v) -> str:
    return str(vars(v)) if isinstance(v, RopeScalingConfig) else repr(v)
