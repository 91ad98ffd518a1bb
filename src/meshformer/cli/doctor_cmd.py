"""`meshformer doctor CONFIG [--target-samples-per-s X] [plan's flags]`: validate a config, plan it, and say what to
change, most urgent first (planner/doctor.py). Exit 0: nothing wrong; 1: a problem (out of memory, an
impossible target); 2: the config itself is invalid."""

from __future__ import annotations

import math

from meshformer.cli import plan_cmd
from meshformer.cli.commands import add_command
from meshformer.errors import UserError


def add_parser(sub) -> None:
    p = add_command(
        sub, "doctor", "check a config against memory, bubble, topology and throughput, and say what to change", __doc__
    )
    plan_cmd.add_machine_arguments(p)
    p.add_argument(
        "--target-samples-per-s", type=float, default=None, metavar="X", help="a throughput the run must reach"
    )
    p.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from meshformer.planner.doctor import diagnose

    target = args.target_samples_per_s
    if target is not None and not (math.isfinite(target) and target > 0):
        raise UserError(f"--target-samples-per-s {target}: give the samples per second the run must reach (> 0)")
    args.json = False
    _, plan = plan_cmd.build(args)
    plan_cmd.print_plan(plan)
    findings = diagnose(plan, args.target_samples_per_s)
    console = Console(width=max(Console().width, 132))
    if not findings:
        console.print("[green]doctor: no problems found[/green]")
        return 0
    for i, f in enumerate(findings, 1):
        colour = "red" if f.severity == "error" else "yellow"
        console.print(f"[{colour}]{i}. {f.severity}:[/{colour}] {escape(f.text)}", soft_wrap=True)
    return 1 if any(f.severity == "error" for f in findings) else 0
