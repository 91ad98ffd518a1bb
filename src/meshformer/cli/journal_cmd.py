"""`meshformer journal [DIR or FILE]`: the tuning journal as a table, one row per run with its config change."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("journal", help="print the tuning journal (config changes and their figures)")
    p.add_argument("path", nargs="?", default=".", help="journal.jsonl or the directory holding it (default: .)")
    p.add_argument("--json", action="store_true", help="print the lines as JSON")
    p.set_defaults(func=run)


def _mem(v) -> str:
    if not isinstance(v, (int, float)) or not v:
        return "-"
    return f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB"


def _num(v, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def describe_changes(changes: dict, limit: int = 4) -> str:
    parts = [f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()]
    more = f" (+{len(parts) - limit} more)" if len(parts) > limit else ""
    return "; ".join(parts[:limit]) + more if parts else "(first run)"


def run(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from meshformer.errors import UserError
    from meshformer.observe.journal import read_journal

    path = Path(args.path)
    path = path / "journal.jsonl" if path.is_dir() else path
    lines = read_journal(path)
    if not lines:
        raise UserError(f"{path}: no journal lines (every training run appends one; see monitor_config.journal)")
    if args.json:
        for line in lines:
            print(json.dumps(line))
        return 0
    table = Table(title=str(path))
    for col in ("#", "time", "run", "change", "layout", "batch", "tokens/s", "MFU", "peak memory", "loss", "eval"):
        table.add_column(col, overflow="fold")
    for i, ln in enumerate(lines, 1):
        table.add_row(
            str(i),
            str(ln.get("time", ""))[:19],
            Path(ln.get("output_dir", "")).name,
            describe_changes(ln.get("changes", {})),
            str(ln.get("layout", "")),
            str(ln.get("global_batch", "")),
            _num(ln.get("tokens_per_s"), ",.0f"),
            _num(ln.get("mfu"), ".1%"),
            _mem(ln.get("peak_mem_bytes")),
            _num(ln.get("loss"), ".4f"),
            _num(ln.get("eval_loss"), ".4f"),
        )
    Console(width=200).print(table)
    return 0
