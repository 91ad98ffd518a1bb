"""MindSpore Transformers models in and out: a consolidated checkpoint plus the YAML it was trained with -> the model
meshformer builds, and a meshformer model's weights -> MindSpore Transformers' names.

The YAML gives the shape (`model.model_config`, read by meshformer's own loader, which knows MindSpore's field
names) and the tokenizer (`processor.tokenizer.tokenizer_file`, or `vocab_file`, naming a Hugging Face
tokenizer.json or its folder; a SentencePiece tokenizer.model or vocab.json with a tokenizer.json beside it means
that one); the model family's `mindspore_names` renames the tensors and splits fused
projections. Every tensor is checked against the model the YAML describes before anything is written, and a
mismatch names MindSpore's tensor and the fix. The writing itself is `meshformer import`'s (interop/convert.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from meshformer.config.schema import MeshformerConfig
from meshformer.errors import UserError
from meshformer.interop.mindspore_ckpt import read_mindspore_checkpoint, refuse_sharded

SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "n_kv_heads", "intermediate_size", "vocab_size")


@dataclass
class MindSporeModel:
    cfg: MeshformerConfig  # model_config from the YAML, the rest meshformer's defaults (as a Hugging Face import)
    tensors: dict[str, torch.Tensor]  # our names, in model_config.param_init_type
    tokenizer_json: str
    tokenizer_config: dict
    origin: str
    training_state: list[str]  # what the checkpoint held beside the model (optimizer moments, step counters)


def names_of(mc):
    """The family's MindSpore Transformers names, or one line saying the family has none."""
    from meshformer.models import family_of

    family = family_of(mc)
    if family.mindspore_names is None:
        raise UserError(
            f"model.model_config.type={mc.type!r}: the {family.name} family has no MindSpore Transformers names: "
            f"convert it through a Hugging Face directory"
        )
    return family.mindspore_names


def read_mindspore_model(src: str | Path, config: str | Path | None) -> MindSporeModel:
    from meshformer.config.load import load_config
    from meshformer.models.sizes import check_weights_fit

    p = Path(src)
    refuse_sharded(p)
    if config is None:
        raise UserError(
            f"{p}: a MindSpore checkpoint holds no model shape or tokenizer: pass --config MF_YAML, the MindSpore "
            f"Transformers YAML it was trained with"
        )
    yaml_cfg = load_config(config, notices=[])  # MindSpore-only keys are expected here: no notices
    mc = yaml_cfg.model.model_config
    names = names_of(mc)
    check_weights_fit(mc, "cpu", f"{config}: model.model_config")  # a size typo: refused before anything is read
    tok_json, tok_cfg = _tokenizer(yaml_cfg, Path(config))
    ck = read_mindspore_checkpoint(p)
    tensors = names.from_mindspore(ck.tensors, mc, str(p))
    if mc.tie_word_embeddings:
        _check_tied_head(tensors, names, p, Path(config))
        tensors.pop("lm_head.weight", None)  # a tied model's head is its embedding
    _check_shapes(tensors, mc, names, p, Path(config))
    cfg = MeshformerConfig()
    cfg.model.model_config = mc
    from meshformer.dtypes import DTYPE

    dtype = DTYPE[mc.param_init_type]
    tensors = {k: t.to(dtype) for k, t in tensors.items()}
    return MindSporeModel(cfg, tensors, tok_json, tok_cfg, str(p), ck.training_state)


def _tokenizer(cfg: MeshformerConfig, config: Path) -> tuple[str, dict]:
    """(tokenizer.json text, the tokenizer_config.json beside it) that the YAML's processor.tokenizer names."""
    from meshformer.data.tokenizer import load_tokenizer, vocab_size
    from meshformer.interop.hf_dir import read_tokenizer_files

    pt = cfg.processor.tokenizer
    given = [(f, v) for f, v in (("tokenizer_file", pt.tokenizer_file), ("vocab_file", pt.vocab_file)) if v]
    if not given:
        raise UserError(
            f"{config}: processor.tokenizer names no tokenizer: set processor.tokenizer.tokenizer_file to the model's "
            f"Hugging Face tokenizer.json (or its folder); meshformer keeps it with the checkpoint"
        )
    field, value = f"{config}: processor.tokenizer.{given[0][0]}", given[0][1]
    p = Path(value)
    if p.is_file() and p.name != "tokenizer.json" and (p.parent / "tokenizer.json").is_file():
        # MindSpore's tokenizers read a SentencePiece tokenizer.model or a vocab.json; a model folder from the Hugging
        # Face hub holds the same tokenizer as tokenizer.json beside it
        print(f"note: {field}={value!r}: using {p.parent / 'tokenizer.json'} beside it", file=sys.stderr)
        p = p.parent
        value = str(p)
    if p.is_file() and p.suffix != ".json":
        raise UserError(
            f"{field}={value!r} is not a tokenizer.json: meshformer reads Hugging Face tokenizer.json files (convert "
            f"a SentencePiece model with transformers' AutoTokenizer and save_pretrained), or name a folder holding one"
        )
    n = vocab_size(load_tokenizer(value, field))  # one line if missing or not a tokenizer
    mc = cfg.model.model_config
    if n > mc.vocab_size:
        raise UserError(f"{field}={value!r} has {n} tokens, more than model_config.vocab_size={mc.vocab_size}")
    tok = p / "tokenizer.json" if p.is_dir() else p
    if tok.name == "tokenizer.json":
        text, side = read_tokenizer_files(tok.parent)
        return text or "", side
    return tok.read_text(encoding="utf-8"), {}


def _check_tied_head(tensors: dict[str, torch.Tensor], names, src: Path, config: Path) -> None:
    """A YAML that ties the head to the embedding over a checkpoint with a head of its own would drop that head
    (the model's output would change without a word): refused, unless the head is the embedding itself."""
    head, embedding = tensors.get("lm_head.weight"), tensors.get("embed_tokens.weight")
    if head is None or (embedding is not None and head.shape == embedding.shape and torch.equal(head, embedding)):
        return
    raise UserError(
        f"{config}: model_config.tie_word_embeddings is true, but {src} holds its own output head "
        f"{names.name_of('lm_head.weight')} (not equal to {names.name_of('embed_tokens.weight')}), which tying "
        f"would drop: set tie_word_embeddings: false in the YAML"
    )


def _check_shapes(tensors: dict[str, torch.Tensor], mc, names, src: Path, config: Path) -> None:
    """One line naming MindSpore's tensor when the checkpoint is not exactly the model the YAML describes."""
    from meshformer.models import build_model, family_of

    expected = {k: tuple(v.shape) for k, v in build_model(mc).state_dict().items()}  # meta tensors: no memory
    fields = ", ".join((*SHAPE_FIELDS, *family_of(mc).shape_fields))  # the family's own shape fields too
    fix = f"give the YAML the checkpoint was trained with ({config}'s model_config: {fields})"
    missing = [k for k in expected if k not in tensors]
    if missing:
        raise UserError(
            f"{src}: tensor {names.name_of(missing[0])} is missing ({len(missing)} of the {len(expected)} the "
            f"model_config describes): the checkpoint is incomplete or of a smaller model; {fix}"
        )
    extra = [k for k in tensors if k not in expected]
    if extra:
        raise UserError(
            f"{src}: tensor {names.name_of(extra[0])} is not in the model the model_config describes "
            f"({len(extra)} such tensors): {fix}"
        )
    for k, want in expected.items():
        if tuple(tensors[k].shape) != want:
            raise UserError(
                f"{src}: tensor {names.name_of(k)} is {list(tensors[k].shape)} in the checkpoint but "
                f"{list(want)} in the model the model_config describes: {fix}"
            )


def mindspore_tensors(state: dict[str, torch.Tensor], mc, fused: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A model's weights under MindSpore Transformers' names (fused q/k/v and gate/up with `fused`), in `dtype`."""
    return {k: v.to(dtype) for k, v in names_of(mc).to_mindspore(state, mc, fused).items()}
