"""Tests by kind: every test file sits in its kind's folder (tests/unit, parity, cli, faults, refs), and a unit test
imports no reference library and launches nothing."""

from __future__ import annotations

import ast

from conftest import ROOT
from test_private_api_scan import dotted

SRC = ROOT / "src"


TESTS = ROOT / "tests"
KINDS = ("unit", "parity", "cli", "faults", "refs")
# What tests/refs/ compares with: a unit test imports none of them, directly or through conftest's helpers.
REFERENCES = {
    "transformers",
    "peft",
    "trl",
    "megatron",
    "mindspore",
    "lm_eval",
    "datasets",
    "gguf",
    "wandb",
    "mlflow",
    "swanlab",
}
REFERENCE_HELPERS = {"save_hf_model", "exports_as_the_original", "imports_with_its_logits", "transformers_render"}
LAUNCH_NAMES = {"TORCHRUN", "DIST", "torchrun_env"}  # conftest's: torchrun's command, the workers it runs, its env
SPAWNS = {("subprocess", n) for n in ("run", "Popen", "call", "check_call", "check_output")} | {
    ("os", n) for n in ("system", "popen", "execv", "execvp", "spawnv", "spawnl")
}


def _fresh_interpreter(call: ast.Call) -> bool:
    """`[sys.executable, "-c", CODE, ...]`: one more interpreter for a clean import state, not the CLI or torchrun."""
    cmd = call.args[0] if call.args else None
    return (
        isinstance(cmd, ast.List)
        and len(cmd.elts) >= 2
        and dotted(cmd.elts[0]) == "sys.executable"
        and isinstance(cmd.elts[1], ast.Constant)
        and cmd.elts[1].value == "-c"
    )


def unit_violations(source: str) -> list[tuple[int, str]]:
    """(line, what) for each reference library a test imports (function-level and importorskip included) and each
    process it launches other than a fresh `python -c` interpreter: what keeps a file out of tests/unit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"imports {a.name}") for a in node.names if a.name.split(".")[0] in REFERENCES]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in REFERENCES:
                found.append((node.lineno, f"imports {node.module}"))
            elif node.module == "conftest":
                used = sorted({a.name for a in node.names} & (REFERENCE_HELPERS | LAUNCH_NAMES))
                found += [(node.lineno, f"uses conftest's {name}") for name in used]
        elif isinstance(node, ast.Call):
            name = dotted(node.func) or ""
            module = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            if name.endswith("importorskip") and str(module).split(".")[0] in REFERENCES:
                found.append((node.lineno, f"imports {module}"))
            elif tuple(name.split(".")[-2:]) in SPAWNS and not _fresh_interpreter(node):
                found.append((node.lineno, f"launches a process ({name})"))
    return found


def test_every_test_file_sits_in_its_kinds_folder():
    """tests/ holds conftest.py, tests/dist/ (what torchrun launches) and one folder per kind; `make test-unit`
    (tests/unit) is the quick loop, `make test` runs them all."""
    stray = [p.name for p in TESTS.glob("*.py") if p.name != "conftest.py"]
    assert not stray, f"sort these into tests/<kind>/ ({', '.join(KINDS)}): {stray}"
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {*KINDS, "dist"}, folders
    assert not list((TESTS / "dist").glob("test_*.py")), "tests/dist/ holds workers, not tests"
    pythonpath = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert all(f'"tests/{kind}"' in pythonpath for kind in KINDS)  # `from test_memory import compare` across kinds


def test_unit_tests_import_no_reference_and_launch_nothing():
    files = sorted((TESTS / "unit").glob("test_*.py"))
    assert any(p.name == "test_structure.py" for p in files)
    offenders = [
        f"tests/unit/{p.name}:{line}: {what}"
        for p in files
        for line, what in unit_violations(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, "move these to tests/refs, tests/cli or tests/parity:\n" + "\n".join(offenders)


def test_unit_scan_finds_planted_references_and_launches():
    planted = (
        "import transformers\nfrom peft import LoraConfig\nfrom conftest import DIST, save_hf_model, tiny_overrides\n"
        "def test_x(cmd):\n    from megatron.core import parallel_state\n    pytest.importorskip('mindspore')\n"
        "    subprocess.run([sys.executable, '-m', 'meshformer', 'train'])\n    subprocess.Popen(cmd)\n"
        "    subprocess.run([sys.executable, '-c', 'import meshformer'])\n    pytest.importorskip('test_memory')\n"
    )
    assert [line for line, _ in unit_violations(planted)] == [1, 2, 3, 3, 5, 6, 7, 8]


def test_test_modules_imported_across_kinds_exist():
    """`from test_x import ...` and `importorskip("test_x")` find test_x in any kind's folder (pyproject.toml's
    pythonpath); a name that no longer exists would make importorskip skip in silence."""
    have = {p.stem for p in TESTS.glob("*/test_*.py")}
    named = set()
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                named.add((path.name, node.module))
            elif isinstance(node, ast.Import):
                named |= {(path.name, a.name) for a in node.names if a.name.startswith("test_")}
            elif isinstance(node, ast.Call) and (dotted(node.func) or "").endswith("importorskip") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("test_"):
                    named.add((path.name, arg.value))
    assert len(named) > 5
    missing = sorted(f"{importer} imports {module}" for importer, module in named if module not in have)
    assert not missing, missing
