"""Reading a YAML config file safely: `yaml.safe_load` semantics, duplicate keys refused, and bounds on size,
alias expansion and nesting so that hostile or accidental input is refused as it is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshformer.errors import UserError

# A config is a few hundred lines; past these bounds the input is data or an attack, and refusing it at load keeps
# every later copy (the config.yaml in each checkpoint, the journal) small.
MAX_CONFIG_BYTES = 1 << 20
# Nodes a document expands to with every alias followed: nested anchors ("billion laughs") share nodes while
# loading, so loading is quick, but each dump or deepcopy afterwards walks the full expansion (9 levels of 10
# aliases are 10**9 nodes: a checkpoint save that never ends; docs/benchmarks.md).
MAX_YAML_NODES = 100_000
# Sections inside sections: a config needs a handful. PyYAML's scanner slows with the square of the flow depth
# (docs/benchmarks.md), so deeper input is refused as it is read, not after.
MAX_YAML_DEPTH = 64


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently,
    so a pasted second `learning_rate:` would quietly win)."""

    depth = 0

    def _too_deep(self) -> UserError:
        return UserError(
            f"{self.name}: the YAML nests more than {MAX_YAML_DEPTH} levels deep (line {self.get_mark().line + 1}): "
            "a config is a few levels of sections"
        )

    def fetch_flow_collection_start(self, TokenClass):
        if self.flow_level >= MAX_YAML_DEPTH:
            raise self._too_deep()
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise self._too_deep()
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys given beside it override the base's
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise UserError(
                    f"{self.name}: key {key!r} appears twice in one section (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}): keep one"
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def expanded_nodes(root: yaml.Node, name: str, limit: int = MAX_YAML_NODES) -> int:
    """Nodes of `root` with every alias expanded, counted on the shared node graph (each distinct node once, and
    without recursion: a 1 MiB file may nest deeper than Python's stack); refuses past `limit`, or a node that
    contains itself."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in _children(node))
            if size[key] > limit:
                raise UserError(
                    f"{name}: the YAML expands to more than {limit:,} values once its aliases (*name) are followed "
                    f"(line {node.start_mark.line + 1}): a config is not data; write the values out, or drop the "
                    "nested anchors"
                )
            continue
        if key in size:
            continue
        if key in on_path:
            raise UserError(
                f"{name}: the YAML anchor at line {node.start_mark.line + 1} contains an alias to itself: a config "
                "must be a tree; write the values out"
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    return size[id(root)]


def load_yaml_text(text: str, name: str) -> Any:
    """YAML text -> plain data: safe types only, no repeated keys, a bounded expansion. Malformed YAML raises
    yaml.YAMLError (the caller knows whether that is an error); a bomb or a document nested too deeply is a
    UserError."""
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded_nodes(node, name)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file {str(p)!r} is a directory: pass the path of a YAML file in it")
    if not p.is_file():
        raise UserError(f"config file {str(p)!r} not found: pass the path of a YAML file")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise UserError(
            f"config file {str(p)!r} is {size / (1 << 20):,.1f} MiB, over the {MAX_CONFIG_BYTES >> 20} MiB limit: a "
            "config is not data (it is copied into every checkpoint); keep data in the files the config names"
        )
    raw = p.read_bytes()
    if b"\x00" in raw[:8192]:
        raise UserError(f"config file {str(p)!r} is binary, not YAML: pass a YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}): pass a YAML file") from None
    try:
        data = load_yaml_text(text, str(p))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{p}: malformed YAML{where}: {problem}; fix the indentation or quoting there") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(
            f"{p}: the top level must be a mapping of sections (run_mode:, model:, ...), not {type(data).__name__}"
        )
    return data
