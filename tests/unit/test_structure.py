"""The code's shape, checked: no import cycles, imports in their layers, functions as outlines, one training step, the
TP plan beside the model, quiet imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from conftest import ROOT

SRC = ROOT / "src"
sys.path.insert(0, str(ROOT / "tests" / "dist"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """meshformer module -> the meshformer modules it imports, at any depth of the file (function-level imports
    count: they are cycles that only wait for the first call). Importing a.b.c also runs a and a.b, except the
    packages that contain the importer (already initialising)."""
    files = {module_name(p): p for p in (SRC / "meshformer").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files)
        edges = set()
        for t in targets:
            bits = t.split(".")
            for i in range(1, len(bits) + 1):
                anc = ".".join(bits[:i])
                if anc in files and not (mod == anc or mod.startswith(anc + ".")):
                    edges.add(anc)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 30 and "meshformer.train.step" in graph["meshformer.train.trainer"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# The layers, top first (docs/design.md): a module imports only from its own layer or those below. The ground
# (errors, dtypes, backends, tolerance) is everything not named here.
# interop (the formats users bring and take) sits above train: the trainer imports no converter, it is handed the
# model sources it accepts (train/base_source.py).
LAYERS = {"__main__": 9, "cli": 8, "planner": 7, "interop": 6, "train": 5, "checkpoint": 4, "parallel": 4}
LAYERS.update({"observe": 3, "models": 3, "config": 2, "data": 1})


def layer_of(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0  # the package root imports nothing of its own


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def test_imports_follow_the_layers():
    """cli > planner > interop > train > checkpoint/parallel > observe/models > config > data > ground,
    function-level imports included (import_graph): neither the trainer nor training checkpoints import a format."""
    assert layer_violations(import_graph()) == []
    planted = {"meshformer.config.validate": {"meshformer.train.loss_scale"}, "meshformer.cli.main": {"meshformer"}}
    assert layer_violations(planted) == ["meshformer.config.validate -> meshformer.train.loss_scale"]
    converter = {
        "meshformer.train.loading": {"meshformer.interop.convert"},
        "meshformer.checkpoint.tools": {"meshformer.interop"},
    }
    assert layer_violations(converter) == [
        "meshformer.checkpoint.tools -> meshformer.interop",
        "meshformer.train.loading -> meshformer.interop.convert",
    ]


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_parity_harness_runs_the_trainers_step_not_a_copy():
    """The parity suite must prove the trainer: the harness may not define its own loss, parameter groups,
    optimizer or step, only call meshformer.train.step / train.optim (which the trainer calls too)."""
    tree = ast.parse((ROOT / "tests" / "dist" / "harness.py").read_text(encoding="utf-8"))
    imported = {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "meshformer.train.step"
        for a in n.names
    }
    assert {"build_parts", "train_step", "evaluate"} <= imported
    called = {
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    forbidden = {
        "cross_entropy",
        "AdamW",
        "forward_backward",
        "clip_grad_norm_",
        "backward",
        "param_groups",
        "make_loss_fn",
        "parallelize",
        "materialize",
        "build_model",
    }
    assert not called & forbidden, called & forbidden
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not {d for d in defined if "loss" in d or "group" in d or "optim" in d}, defined
    text = (ROOT / "tests" / "dist" / "harness.py").read_text(encoding="utf-8")
    assert "no_decay" not in text and "ignore_index=-100" not in text
    trainer = (SRC / "meshformer" / "train" / "trainer.py").read_text(encoding="utf-8")
    evaluation = (SRC / "meshformer" / "train" / "evaluation.py").read_text(encoding="utf-8")
    assert "train_step(" in trainer and "build_parts(" in trainer
    from_step = {
        a.name
        for n in ast.walk(ast.parse(evaluation))
        if isinstance(n, ast.ImportFrom) and n.module == "meshformer.train.step"
        for a in n.names
    }
    assert "evaluate" in from_step  # the validation loss is the parity suite's evaluate, not a copy
    for source in (trainer, evaluation):
        assert "forward_backward" not in source and "cross_entropy" not in source


MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of each function in `source` longer than `limit` lines, from its `def` to its last line."""
    return [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit
    ]


def test_functions_read_as_outlines():
    """No function in src/ over 80 lines: the loop, the step, the planner and the converters stay an outline of
    named pieces."""
    files = sorted((SRC / "meshformer").rglob("*.py"))
    assert any(p.name == "trainer.py" for p in files) and any(p.name == "memory.py" for p in files)
    offenders = [
        f"{p.relative_to(SRC)}: {name} has {lines} lines"
        for p in files
        for name, lines in long_functions(p.read_text(encoding="utf-8"), MAX_FUNCTION_LINES)
    ]
    assert not offenders, "\n".join(offenders)


def test_function_length_counts_from_def_to_the_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    assert long_functions(f"def short():\n{body[: body.rindex(chr(10))]}\n", 80) == []  # 80 lines with its def
    assert long_functions(f"def long():\n{body}\n", 80) == [("long", 81)]
    nested = f"class A:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    assert long_functions(nested, 80) == [("method", 81)]


def test_importing_meshformer_installs_no_warning_filters():
    """Only torch's and numpy's own filters may appear; a global filter of ours would hide users' warnings."""
    code = (
        "import warnings, torch, torch.distributed.checkpoint, numpy; before = list(warnings.filters); "
        "import meshformer.train.trainer, meshformer.checkpoint.store, meshformer.cli.main; "
        "print([f[1].pattern if f[1] else None for f in warnings.filters if f not in before])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_tests_find_shared_relative_to_the_repository():
    for path in (ROOT / "tests").rglob("*.py"):
        assert "/".join(["", "work", "shared"]) not in path.read_text(encoding="utf-8"), path


# ---------------------------------------------------------------- tensor-parallel plan (no process group)


def _tiny(**kw):
    from meshformer.models.registry import model_config

    base = dict(
        hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, vocab_size=64, seq_length=8, intermediate_size=48
    )
    return model_config(**{**base, **kw})


def _covered(model: nn.Module, resolved: dict[str, str]) -> set[str]:
    return {f"{m}.{p}" for m in resolved for p, _ in model.get_submodule(m).named_parameters(recurse=False)}


@pytest.mark.parametrize("kw", [{}, {"tie_word_embeddings": True}, {"qkv_has_bias": True, "use_qk_norm": True}])
def test_llama_plan_covers_every_parameter_exactly_once(kw):
    from meshformer.models import build_model
    from meshformer.parallel.tp import make_style, resolve_plan

    model = build_model(_tiny(**kw))
    resolved = resolve_plan(model, model.tp_plan())
    names = {n for n, _ in model.named_parameters()}
    assert _covered(model, resolved) == names
    assert resolved["layers.1.self_attn.q_proj"] == "colwise" and resolved["layers.0.mlp.down_proj"] == "rowwise"
    assert resolved["norm"] == ("norm_to_head" if kw.get("tie_word_embeddings") else "norm")
    for style in set(resolved.values()):
        make_style(style, seq_parallel=True)  # every name the model uses is one the applier knows


def test_plan_reaches_a_pipeline_stage_and_a_wrapped_layer():
    import harness
    from meshformer.models import build_model
    from meshformer.parallel.tp import resolve_plan

    model = build_model(_tiny())
    model.embed_tokens, model.norm, model.lm_head = None, None, None  # a middle pipeline stage
    del model.layers["0"]
    harness._wrap_decoder_linears(model, None)
    resolved = resolve_plan(model, model.tp_plan())
    assert "layers.1.self_attn.q_proj.base_layer" in resolved and "layers.1.self_attn.q_proj" not in resolved
    assert resolved["layers.1.mlp.down_proj.base_layer"] == "rowwise"
    assert _covered(model, resolved) == {n for n, _ in model.named_parameters()}
    assert not any(k.startswith(("layers.0", "embed_tokens", "lm_head")) for k in resolved)


def test_unknown_style_is_an_error():
    from meshformer.parallel.tp import make_style

    with pytest.raises(ValueError, match="unknown tensor-parallel style 'colwize'"):
        make_style("colwize", seq_parallel=False)
    assert make_style("gather_sequence", seq_parallel=False) is None
