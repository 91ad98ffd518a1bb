"""The code's shape, checked: no import cycles, one training step, the TP plan beside the model, quiet imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from conftest import ROOT

SRC = ROOT / "src"
sys.path.insert(0, str(ROOT / "tests" / "dist"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """meshformer module -> the meshformer modules it imports, at any depth of the file (function-level imports
    count: they are cycles that only wait for the first call). Importing a.b.c also runs a and a.b, except the
    packages that contain the importer (already initialising)."""
    files = {_module_name(p): p for p in (SRC / "meshformer").rglob("*.py")}
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


# ---------------------------------------------------------------- private torch APIs: backends/torch_private.py only

TORCH_PRIVATE = SRC / "meshformer" / "backends" / "torch_private.py"


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _private_torch_name(name: str) -> bool:
    """A torch name with a segment under a single leading underscore: torch._x, torch.ops._x, torch.ops.aten._x,
    torch.utils._x, torch.testing._internal, ... (dunders such as torch.__version__ are public)."""
    root, *rest = name.split(".")
    return root == "torch" and any(b.startswith("_") and not (b.startswith("__") and b.endswith("__")) for b in rest)


def private_torch_uses(source: str, in_backends: bool = False) -> list[tuple[int, str]]:
    """(line, what) for each private torch API `source` names (imports, attribute chains, also through an alias such
    as `aten = torch.ops.aten`, getattr/hasattr with an underscored name), each DeviceMesh-style `._flatten`, and
    each `x.__class__ = ...` outside backends/ (the class swap is CPU tuning, backends/cpu.py)."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}

    def resolve(dotted: str) -> str:
        root, _, rest = dotted.partition(".")
        return alias.get(root, root) + (f".{rest}" if rest else "")

    hits: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
                if _private_torch_name(a.name):
                    hits.add((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = full = f"{node.module}.{a.name}"
                if _private_torch_name(full):
                    hits.add((node.lineno, full))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if (value := _dotted(node.value)) is not None:
                alias[node.targets[0].id] = resolve(value)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "_flatten":
                hits.add((node.lineno, "._flatten"))
            if id(node) not in inner and (dotted := _dotted(node)) and _private_torch_name(full := resolve(dotted)):
                hits.add((node.lineno, full))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            obj, name = (node.args + [None, None])[:2]
            target = _dotted(obj) if obj is not None else None
            if target and isinstance(name, ast.Constant) and isinstance(name.value, str):
                if _private_torch_name(full := f"{resolve(target)}.{name.value}"):
                    hits.add((node.lineno, full))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and not in_backends:
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute) and t.attr == "__class__":
                    hits.add((node.lineno, "__class__ = (a class swap: backends/)"))
    return sorted(hits)


def test_private_torch_apis_only_in_torch_private():
    """A private torch name can change in any release: calling it only through backends/torch_private.py (each
    wrapped once, with the release it was checked on) keeps an upgrade's breakage in one file."""
    offenders = [
        f"{rel}:{line}: {what}"
        for rel in sorted(p.relative_to(SRC) for p in (SRC / "meshformer").rglob("*.py"))
        if SRC / rel != TORCH_PRIVATE
        for line, what in private_torch_uses((SRC / rel).read_text(encoding="utf-8"), "backends" in rel.parts)
    ]
    assert not offenders, "private torch APIs outside backends/torch_private.py:\n" + "\n".join(offenders)


def test_private_api_scan_finds_planted_uses():
    code = "\n".join(
        [
            "import torch",  # 1: public
            "from torch._subclasses.fake_tensor import FakeTensorMode",  # 2
            "from torch.distributed import _composable",  # 3
            "from torch.testing._internal.distributed.fake_pg import FakeStore",  # 4
            "import torch.utils._pytree as pytree",  # 5
            "aten = torch.ops.aten",  # 6: public
            "ops = {aten.mm, aten._scaled_dot_product_flash_attention}",  # 7: through the alias
            "torch._foreach_mul_([], 2.0)",  # 8
            "x = torch.ops._c10d_functional.all_reduce",  # 9
            "ok = hasattr(torch.ops, '_c10d_functional')",  # 10
            "mesh['dp']._flatten('dp_flat')",  # 11
            "m.__class__ = type(m)",  # 12
            "y = torch.__version__, torch.nn.functional.linear, torch.ops.mkldnn.linear",  # 13: public
            "z = torch.ops.mkldnn._linear_pointwise",  # 14
        ]
    )
    assert {line for line, _ in private_torch_uses(code)} == {2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 14}
    assert private_torch_uses("m.__class__ = type(m)", in_backends=True) == []  # backends/cpu.py's swap
    # The wrappers' own file holds what the scan flags anywhere else.
    assert len(private_torch_uses(TORCH_PRIVATE.read_text(encoding="utf-8"))) >= 8


# Underscored attributes of objects that are not meshformer's, each allowed with its reason: none is torch's.
FOREIGN_PRIVATE_ALLOWED = {
    "_exit": "os._exit, public in the standard library",
    "_actions": "argparse (the CLI's one-line errors and its help), not torch",
    "_subparsers": "argparse, not torch",
    "_group_actions": "argparse, not torch",
    "_option_string_actions": "argparse, not torch",
    "_attn_implementation": "transformers' config (--verify switches the reference's attention), not torch",
}


def _meshformer_attribute_names(sources: list[str]) -> set[str]:
    """Every name meshformer defines that an attribute could carry: functions, classes, class-level and module
    assignments, and attributes it assigns (`x._name = ...`)."""
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def foreign_private_attributes(source: str, own: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each underscored attribute `source` reads off an object (`sched._stages`,
    `getattr(sched, "_stages", None)`) that meshformer itself never defines: a private attribute of someone else's
    object, torch's unless FOREIGN_PRIVATE_ALLOWED says otherwise. Dunders and `self.` / `cls.` reads are left
    alone (a class's own attributes)."""

    def private(name: str) -> bool:
        dunder = name.startswith("__") and name.endswith("__")
        return name.startswith("_") and not dunder and name not in own and name not in FOREIGN_PRIVATE_ALLOWED

    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                hits.add((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr"):
            if len(node.args) >= 2 and isinstance(name := node.args[1], ast.Constant) and isinstance(name.value, str):
                if private(name.value):
                    hits.add((node.lineno, name.value))
    return sorted(hits)


def test_private_attributes_of_torch_objects_only_in_torch_private():
    """A torch object's underscored attribute (a schedule's `_stages`, a tensor's `_base`, a DTensor's
    `_local_tensor`) is as private as `torch._x`: read only through backends/torch_private.py."""
    files = sorted((SRC / "meshformer").rglob("*.py"))
    sources = {p: p.read_text(encoding="utf-8") for p in files}
    own = _meshformer_attribute_names([s for p, s in sources.items() if p != TORCH_PRIVATE])
    offenders = [
        f"{p.relative_to(SRC)}:{line}: .{name}"
        for p, s in sources.items()
        if p != TORCH_PRIVATE
        for line, name in foreign_private_attributes(s, own)
    ]
    assert not offenders, "private attributes of torch objects outside backends/torch_private.py:\n" + "\n".join(
        offenders
    )


def test_foreign_private_attribute_scan_finds_planted_reads():
    code = "\n".join(
        [
            "stages = getattr(sched, '_stages', None) or [sched._stage]",  # 1: a pipeline schedule's
            "base = t._base",  # 2: a tensor's
            "x = self._mine + obj._mine + self._theirs",  # 3: meshformer's own (defined below), self's
            "obj._mine = 1",  # 4
            "os._exit(1)",  # 5: allowed
            "ok = hasattr(cls, '_load_actions')",  # 6
        ]
    )
    own = _meshformer_attribute_names([code])
    assert foreign_private_attributes(code, own) == [(1, "_stage"), (1, "_stages"), (2, "_base"), (6, "_load_actions")]
    assert foreign_private_attributes(TORCH_PRIVATE.read_text(encoding="utf-8"), set()) != []


# ---------------------------------------------------------------- a family is its folder

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
        module = _module_name(path)
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


# ---------------------------------------------------------------- tests by kind (tests/<kind>/)

TESTS = ROOT / "tests"
KINDS = ("unit", "parity", "cli", "faults", "refs")
# What tests/refs/ compares with: a unit test imports none of them, directly or through conftest's helpers.
REFERENCES = {"transformers", "peft", "trl", "megatron", "mindspore", "lm_eval", "datasets", "gguf"}
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
        and _dotted(cmd.elts[0]) == "sys.executable"
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
            name = _dotted(node.func) or ""
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
            elif isinstance(node, ast.Call) and (_dotted(node.func) or "").endswith("importorskip") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("test_"):
                    named.add((path.name, arg.value))
    assert len(named) > 5
    missing = sorted(f"{importer} imports {module}" for importer, module in named if module not in have)
    assert not missing, missing
