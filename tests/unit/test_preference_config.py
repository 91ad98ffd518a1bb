"""The preference_config section (config/preference_schema.py): TRL's names, LLaMA-Factory's aliases, and the rules
that refuse a run that cannot be what it says, in one line each."""

import json

import pytest

from conftest import EMPTY, fails
from meshformer.config.load import load_config
from meshformer.config.validate import validate_config
from meshformer.errors import UserError


def _cfg(tmp_path, block: dict, extra: str = ""):
    path = tmp_path / "c.yaml"
    path.write_text(f"preference_config: {json.dumps(block)}\n{extra}")
    cfg = load_config(path)
    validate_config(cfg)
    return cfg.preference_config


def test_defaults_are_trls_and_the_block_is_inert():
    pc = load_config(EMPTY).preference_config
    assert (pc.method, pc.loss_type, pc.beta, pc.label_smoothing, pc.simpo_gamma) == ("none", "sigmoid", 0.1, 0.0, 0.5)
    assert (pc.desirable_weight, pc.undesirable_weight, pc.sft_weight, pc.reference) == (1.0, 1.0, 0.0, None)


def test_trl_names_and_a_weighted_list(tmp_path):
    pc = _cfg(tmp_path, {"method": "dpo", "loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1]})
    assert pc.loss_types() == ["sigmoid", "bco_pair", "sft"] and pc.reference_kind() == "copy"


def test_llama_factory_aliases(tmp_path):
    pc = _cfg(tmp_path, {"method": "dpo", "pref_beta": 0.25, "pref_loss": "hinge", "pref_ftx": 0.5})
    assert (pc.beta, pc.loss_type, pc.sft_weight) == (0.25, "hinge", 0.5)
    pc = _cfg(tmp_path, {"pref_loss": "simpo", "pref_beta": 2.0})  # LLaMA-Factory's pref_loss names the method
    assert (pc.method, pc.loss_type, pc.reference_kind()) == ("simpo", "sigmoid", "none")
    pc = _cfg(tmp_path, {"method": "kto", "loss_type": "kto", "kto_chosen_weight": 1.5})
    assert pc.desirable_weight == 1.5
    pc = _cfg(
        tmp_path, {"method": "kto", "pref_loss": "sigmoid", "kto_rejected_weight": 0.5}
    )  # LLaMA-Factory's default
    assert (pc.loss_type, pc.undesirable_weight) == ("kto", 0.5)


LORA = "model: {model_config: {pet_config: {pet_type: lora}}}\n"


@pytest.mark.parametrize(
    "block, extra, needles",
    [
        ({"method": "dpo", "beta": 0}, "", ("preference_config.beta=0", "> 0")),
        ({"method": "dpo", "beta": -1}, "", ("preference_config.beta=-1",)),
        ({"method": "dpo", "reference": "adapter"}, "", ("reference=adapter", "LoRA is not on", "pet_type: lora")),
        ({"method": "dpo", "reference": "none"}, "", ("reference=none", "orpo or simpo")),
        ({"method": "simpo", "reference": "copy"}, "", ("reference=copy", "no reference")),
        ({"method": "dpo", "loss_type": "sigmoidd"}, "", ("loss_type=sigmoidd", "choose from")),
        ({"method": "kto", "loss_type": "hinge"}, "", ("loss_type=hinge", "kto loss type")),
        ({"method": "dpo", "loss_type": ["sigmoid", "sft"], "loss_weights": [1]}, "", ("loss_weights", "one weight")),
        ({"method": "dpo", "label_smoothing": 0.1}, "", ("label_smoothing=0.1", "robust", "cdpo")),
        ({"method": "dpo", "loss_type": "robust", "label_smoothing": 0.5}, "", ("label_smoothing=0.5", "< 0.5")),
        ({"method": "orpo", "loss_type": "hinge"}, "", ("loss_type=hinge", "remove loss_type")),
        ({"method": "dpo", "betta": 0.2}, "", ("preference_config.betta", "did you mean", "beta")),
        ({"method": "dpoo"}, "", ("method='dpoo'", "did you mean 'dpo'")),
        ({"pref_loss": "kto_pair"}, "", ("kto_pair", "method: kto")),
    ],
)
def test_bad_preference_config_is_one_line(tmp_path, capsys, block, extra, needles):
    path = tmp_path / "c.yaml"
    path.write_text(f"preference_config: {json.dumps(block)}\n{extra}")
    fails(capsys, ["config", "check", str(path)], *needles)


def test_reference_adapter_with_lora_passes(tmp_path):
    assert _cfg(tmp_path, {"method": "dpo", "reference": "adapter"}, LORA).reference_kind() == "adapter"


def _data(tmp_path, kind, fmt="meshformer-preference-v1"):
    d = tmp_path / kind
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"format": fmt, "kind": kind}))
    return f"train_dataset: {{data_loader: {{dataset_dir: {d}}}}}\n"


def test_method_must_match_the_datas_kind(tmp_path, capsys):
    pairs, unpaired, text = (
        _data(tmp_path, "pairs"),
        _data(tmp_path, "unpaired"),
        _data(tmp_path, "x", "meshformer-packed-v1"),
    )
    assert _cfg(tmp_path, {"method": "dpo"}, pairs).method == "dpo"
    assert _cfg(tmp_path, {"method": "kto", "loss_type": "kto"}, unpaired).method == "kto"
    for block, extra, needles in [
        ({"method": "kto", "loss_type": "kto"}, pairs, ("method=kto", "preference pairs", "method: dpo")),
        ({"method": "dpo"}, unpaired, ("method=dpo", "unpaired", "method: kto")),
        ({"method": "orpo"}, text, ("method=orpo", "not preference data")),
    ]:
        with pytest.raises(UserError) as e:
            _cfg(tmp_path, block, extra)
        assert all(n in str(e.value) for n in needles), str(e.value)
