"""`meshformer plot RUN_DIR [RUN_DIR ...] --output FILE.png`: a run's (or several runs') curves in one image."""

from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plot", help="plot loss, lr, grad norm, tokens/s and memory of runs", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output_dir of a training run (several: overlaid)")
    p.add_argument("--output", required=True, metavar="FILE.png", help="where to write the image")
    p.add_argument("--width", type=int, default=1500, help="image width in pixels")
    p.add_argument("--height", type=int, default=900, help="image height in pixels")
    p.set_defaults(func=run)


def run(args) -> int:
    from meshformer.errors import UserError
    from meshformer.observe.plot import plot_runs

    out = Path(args.output)
    if out.suffix.lower() != ".png":
        raise UserError(f"--output {out}: give a .png file name")
    if args.width < 200 or args.height < 200:
        raise UserError("--width/--height: give at least 200 pixels each")
    plot_runs([Path(r) for r in args.runs], out, args.width, args.height)
    print(out)
    return 0
