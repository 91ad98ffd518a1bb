"""A CLI that answers at once: `meshformer --help`, every sub-command's `--help` and an argument error are answered
before torch is imported (importing torch is most of a command's start-up time)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import contextlib, io, json, sys
from meshformer.cli.main import COMMANDS, main
results = {}
for argv in [["--help"], *[[c, "--help"] for c in COMMANDS if c != "config"], ["train"], ["plan", "--bogus"]]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results[" ".join(argv)] = [code, "torch" in sys.modules]
print(json.dumps(results))
"""


def test_help_and_argument_errors_answer_before_torch_loads():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    results = json.loads(out.splitlines()[-1])
    assert results["--help"] == [0, False]
    assert results["train"] == [2, False] and results["plan --bogus"] == [2, False]  # one-line argument errors
    loaded = [argv for argv, (_, torch_loaded) in results.items() if torch_loaded]
    assert not loaded, f"torch imported by: {loaded}"
    assert len(results) > 15  # every sub-command's help was asked


EXPLAIN_PROBE = r"""
import contextlib, io, json, sys
from meshformer.cli.main import main
results = {}
for argv in [["config", "explain"], ["config", "--help"]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results[" ".join(argv)] = [code, "torch" in sys.modules, out.getvalue()]
print(json.dumps(results))
"""


def test_config_explain_and_its_help_answer_before_torch_loads():
    """Both list every family's own fields, read from the families' config.py files, which import no torch."""
    out = subprocess.run([sys.executable, "-c", EXPLAIN_PROBE], capture_output=True, text=True, check=True).stdout
    results = json.loads(out.splitlines()[-1])
    for argv, (code, torch_loaded, text) in results.items():
        assert code == 0 and not torch_loaded, argv
        for field in ("sliding_window", "partial_rotary_factor", "kv_lora_rank", "moe_config.expert_num"):
            assert field in text, (argv, field)


CONFIG_PROBE = r"""
import json, sys
import meshformer.models
from meshformer.models.registry import BUILTIN_FAMILIES, builtin_config_classes, family_config_classes
from meshformer.config.fields import MODEL_CONFIGS
from meshformer.data.formats import dataset_formats
before = {
    "torch": "torch" in sys.modules,
    "types": list(MODEL_CONFIGS),
    "explained": {name: list(types) for name, types in family_config_classes().items()},
    "formats": dataset_formats(),
}
from meshformer.data.formats import FORMATS
from meshformer.data.registry import open_dataset_for
from meshformer.models.registry import families
after = {
    "families": [f.name for f in families()],
    "types": [t for f in families() for t in f.config_types],
    "explained": {f.name: list(f.config_types) for f in families()},
    "formats": sorted(FORMATS),
}
print(json.dumps({"builtin": list(BUILTIN_FAMILIES), "before": before, "after": after}))
"""


def test_the_models_package_registers_config_classes_without_torch_and_families_on_first_use():
    """`import meshformer.models` fills `model_config.type`'s classes from each family's config.py (no torch); the
    registry's first use registers every built-in family, in `BUILTIN_FAMILIES` order, with the same types; the
    dataset formats named without torch are those the format modules register."""
    out = subprocess.run([sys.executable, "-c", CONFIG_PROBE], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    before, after = seen["before"], seen["after"]
    assert before["torch"] is False
    assert after["families"] == seen["builtin"]
    assert before["types"] == after["types"] and before["explained"] == after["explained"]
    assert before["formats"] == after["formats"]
