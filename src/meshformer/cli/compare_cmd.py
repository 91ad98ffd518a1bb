"""`meshformer compare RUN_A RUN_B`: two runs' config difference beside their metric difference."""

from __future__ import annotations

from pathlib import Path

METRICS = (  # (run_summary key, label, format)
    ("tokens_per_s", "tokens/s (median)", ",.0f"),
    ("mfu", "MFU (median)", ".2%"),
    ("step_time_s", "step time s (median)", ".4f"),
    ("peak_mem_bytes", "peak memory bytes", ",.0f"),
    ("loss", "final loss", ".4f"),
    ("eval_loss", "final eval loss", ".4f"),
    ("global_batch", "global batch", "d"),
    ("steps", "steps", "d"),
)


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="config diff and metric diff of two runs", description=__doc__)
    p.add_argument("run_a", metavar="RUN_A", help="output_dir of the first run")
    p.add_argument("run_b", metavar="RUN_B", help="output_dir of the second run")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from meshformer.observe.journal import config_changes, read_summary

    a, b = read_summary(Path(args.run_a)), read_summary(Path(args.run_b))
    changes = config_changes(a["config"], b["config"])
    metrics = {}
    for key, _, _ in METRICS:
        va, vb = a.get(key), b.get(key)
        rel = vb / va - 1 if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else None
        metrics[key] = {"a": va, "b": vb, "change": rel}
    if args.json:
        print(json.dumps({"config": changes, "metrics": metrics}))
        return 0
    console = Console(width=200)
    cfg_table = Table(title=f"config: {args.run_a} -> {args.run_b}")
    for col in ("field", "A", "B"):
        cfg_table.add_column(col, overflow="fold")
    for k, (va, vb) in changes.items():
        cfg_table.add_row(k, repr(va), repr(vb))
    if not changes:
        cfg_table.add_row("(no difference)", "", "")
    met = Table(title="metrics")
    for col in ("metric", "A", "B", "B vs A"):
        met.add_column(col)
    for key, label, fmt in METRICS:
        m = metrics[key]
        show = [format(m[s], fmt) if isinstance(m[s], (int, float)) else "-" for s in ("a", "b")]
        met.add_row(label, *show, f"{m['change']:+.1%}" if m["change"] is not None else "-")
    console.print(cfg_table)
    console.print(met)
    return 0
