"""Private torch APIs are named in backends/torch_private.py only: imports of torch._* and reads of underscored
attributes of objects meshformer does not define, each scan proven on planted code."""

from __future__ import annotations

import ast

from conftest import ROOT

SRC = ROOT / "src"


TORCH_PRIVATE = SRC / "meshformer" / "backends" / "torch_private.py"


def dotted(node: ast.AST) -> str | None:
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
            if (value := dotted(node.value)) is not None:
                alias[node.targets[0].id] = resolve(value)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "_flatten":
                hits.add((node.lineno, "._flatten"))
            if id(node) not in inner and (name := dotted(node)) and _private_torch_name(full := resolve(name)):
                hits.add((node.lineno, full))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            obj, name = (node.args + [None, None])[:2]
            target = dotted(obj) if obj is not None else None
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
