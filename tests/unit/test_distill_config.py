"""The distill_config section (config/distill_schema.py): its defaults leave a run alone, a teacher is a Hugging Face
directory or a meshformer checkpoint / run whose vocabulary is read from its config file before anything is built,
and every bad value is one line with exit code 2."""

import json

import pytest
import yaml

from conftest import EMPTY, fails
from meshformer.config.distill_schema import teacher_vocab_size
from meshformer.config.load import load_config
from meshformer.config.validate import validate_config
from meshformer.errors import UserError

VOCAB = 96


def _hf_teacher(tmp_path, vocab=VOCAB, nested=False):
    d = tmp_path / f"hf{vocab}{'n' if nested else ''}"
    d.mkdir()
    cfg = {"model_type": "llama", "text_config": {"vocab_size": vocab}} if nested else {"vocab_size": vocab}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _run_teacher(tmp_path, vocabs: dict[int, int]):
    """A meshformer run directory with checkpoint/step_N/config.yaml of the given vocab sizes."""
    run = tmp_path / "run"
    for step, vocab in vocabs.items():
        ckpt = run / "checkpoint" / f"step_{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "config.yaml").write_text(yaml.safe_dump({"model": {"model_config": {"vocab_size": vocab}}}))
    return run


def _write(tmp_path, block: dict, extra: str = "") -> str:
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{model_config: {{vocab_size: {VOCAB}}}}}\ndistill_config: {json.dumps(block)}\n{extra}")
    return str(path)


def _cfg(tmp_path, block: dict, extra: str = ""):
    cfg = load_config(_write(tmp_path, block, extra))
    validate_config(cfg)
    return cfg.distill_config


def test_defaults_are_trls_and_the_block_is_inert():
    dc = load_config(EMPTY).distill_config
    assert (dc.teacher, dc.loss, dc.beta, dc.temperature, dc.alpha, dc.top_k) == ("", "forward_kl", 0.5, 1.0, 1.0, None)
    assert not dc.enabled and dc.trl_beta() == 0.0


def test_teachers_vocabulary_is_read_from_its_config_file(tmp_path):
    hf = _hf_teacher(tmp_path)
    dc = _cfg(tmp_path, {"teacher": str(hf), "loss": "jsd", "beta": 0.2, "temperature": 2.0, "alpha": 0.5, "top_k": 8})
    assert dc.enabled and dc.trl_beta() == 0.2 and dc.top_k == 8
    assert teacher_vocab_size(str(_hf_teacher(tmp_path, 50, nested=True)))[0] == 50
    run = _run_teacher(tmp_path, {2: 7, 10: VOCAB})  # the newest checkpoint of a run is the teacher
    assert teacher_vocab_size(str(run)) == (VOCAB, str(run / "checkpoint" / "step_10" / "config.yaml"))
    assert _cfg(tmp_path, {"teacher": str(run), "loss": "reverse_kl"}).trl_beta() == 1.0
    assert _cfg(tmp_path, {"teacher": str(run / "checkpoint" / "step_10")}).enabled


@pytest.mark.parametrize(
    "block, needles",
    [
        ({"loss": "kl"}, ("distill_config.loss='kl'", "forward_kl")),
        ({"beta": 0}, ("distill_config.beta=0", "> 0")),
        ({"beta": 1}, ("distill_config.beta=1", "< 1")),
        ({"temperature": 0}, ("distill_config.temperature=0", "> 0")),
        ({"alpha": 1.5}, ("distill_config.alpha=1.5", "<= 1")),
        ({"top_k": 0}, ("distill_config.top_k=0", ">= 1")),
        ({"temprature": 2}, ("distill_config.temprature", "did you mean", "temperature")),
    ],
)
def test_bad_values_are_one_line(tmp_path, capsys, block, needles):
    fails(capsys, ["config", "check", _write(tmp_path, block)], *needles)


def test_bad_teachers_are_one_line(tmp_path, capsys):
    other = _hf_teacher(tmp_path, 128)
    fails(capsys, ["config", "check", _write(tmp_path, {"teacher": str(other)})], "distill_config.teacher", "128",
          f"student's {VOCAB}", "config.json")  # fmt: skip
    run = _run_teacher(tmp_path, {3: 64})
    fails(capsys, ["config", "check", _write(tmp_path, {"teacher": str(run)})], "64 tokens", "step_3/config.yaml")
    fails(capsys, ["config", "check", _write(tmp_path, {"teacher": str(tmp_path / "nope")})], "no such directory")
    (tmp_path / "empty").mkdir()
    fails(capsys, ["config", "check", _write(tmp_path, {"teacher": str(tmp_path / "empty")})], "neither config.json")
    hf = _hf_teacher(tmp_path)
    fails(capsys, ["config", "check", _write(tmp_path, {"teacher": str(hf), "top_k": VOCAB + 1})],
          "distill_config.top_k=97", "vocabulary")  # fmt: skip
    cp = "parallel_config: {context_parallel: 2}\n"
    fails(capsys, ["config", "check", _write(tmp_path, {"teacher": str(hf)}, cp)], "context_parallel=2", "not run")
    both = "preference_config: {method: simpo}\n"
    fails(capsys, ["config", "check", _write(tmp_path, {"teacher": str(hf)}, both)], "preference_config.method=simpo")
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="names no vocab_size"):
        _cfg(tmp_path, {"teacher": str(hf)})
