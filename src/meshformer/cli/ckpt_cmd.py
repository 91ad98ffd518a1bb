"""`meshformer ckpt info|verify|merge`: look at, check and consolidate checkpoints.

meshformer ckpt info runs/demo                      # every checkpoint of a run: step, layout, sizes, status
meshformer ckpt verify runs/demo/checkpoint/step_00000300   # exit 1 naming the first bad file
meshformer ckpt merge runs/demo --output merged [--optimizer]  # a Hugging Face directory, any saving layout
"""

from __future__ import annotations

import json
import sys

from meshformer.cli.commands import add_command


def add_parser(sub) -> None:
    p = add_command(sub, "ckpt", "inspect, verify or merge checkpoints", __doc__)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    i = verbs.add_parser("info", help="step, layout, model shape, sizes and status of each checkpoint")
    i.add_argument("path", help="a checkpoint/step_N directory or a run's output_dir")
    i.add_argument("--json", action="store_true", help="print JSON")
    v = verbs.add_parser("verify", help="check every file against the manifest and read every tensor back")
    v.add_argument("path", help="a checkpoint/step_N directory or a run's output_dir (all its checkpoints)")
    m = verbs.add_parser("merge", help="write the full (unsharded) weights as a Hugging Face model directory")
    m.add_argument("path", help="a checkpoint/step_N directory or a run's output_dir (its newest good one)")
    m.add_argument("--output", required=True, help="the directory to write (config.json, model.safetensors, ...)")
    m.add_argument("--optimizer", action="store_true", help="also write optimizer.safetensors (AdamW's state)")
    m.add_argument(
        "--overwrite", action="store_true", help="replace an earlier merge's --output (once the new one is done)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from meshformer.checkpoint import store, tools

    if args.verb == "info":
        found = [tools.info(c) for c in tools.checkpoints_of(args.path)]
        if args.json:
            print(json.dumps(found, indent=1))
        for d in [] if args.json else found:
            model = d.get("model") or {}
            shape = ", ".join(f"{k}={v}" for k, v in model.items() if v is not None)
            print(f"{d['path']}\n  step {d.get('step')}  layout {d.get('layout')}  finite loss {d.get('finite')}")
            print(f"  model: {shape or 'config.yaml unreadable'}")
            w, o = d["weights"], d["optimizer"]
            extra = f", {w['tensors']} tensors, {w['parameters']:,} parameters" if "tensors" in w else ""
            print(f"  weights: {w['files']} file(s), {w['bytes']:,} bytes{extra}; optimizer: {o['bytes']:,} bytes")
            print(f"  status: {d['status']}")
        run_dir = not store.is_checkpoint_dir(Path(args.path))
        for aside in store.set_aside_checkpoints(args.path) if run_dir and not args.json else []:
            print(f"{aside}\n  status: damaged, set aside for repair (`meshformer ckpt verify {aside}` says why)")
        return 0
    if args.verb == "verify":
        bad = 0
        for c in tools.checkpoints_of(args.path):
            why = tools.full_verify(c)
            print(f"{c}: {'ok' if why is None else 'BAD: ' + why}")
            bad += why is not None
        if bad:
            print(f"meshformer: {bad} checkpoint(s) failed verification", file=sys.stderr)
        return 1 if bad else 0
    if args.verb == "merge":
        notes: list[str] = []
        ckpt = store.resolve_checkpoint(args.path, notes)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        from meshformer.interop.merge import merge

        done = merge(ckpt, Path(args.output), args.overwrite, args.optimizer)
        extra = f" and {done['optimizer_tensors']} optimizer tensors" if args.optimizer else ""
        print(
            f"wrote {done['output']}: {done['tensors']} weight tensors ({done['dtype']}){extra}, "
            f"{done['bytes']:,} bytes, a Hugging Face model directory (from {ckpt})"
        )
        return 0
    return 2
