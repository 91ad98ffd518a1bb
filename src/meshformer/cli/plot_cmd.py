"""`meshformer plot RUN_DIR [RUN_DIR ...] --output FILE.png`: a run's (or several runs') curves in one image."""

from __future__ import annotations

from pathlib import Path

from meshformer.cli.commands import add_command

# The image is drawn in memory, 4 bytes a pixel: 10000 x 10000 is 400 MB (matplotlib refuses 2**23 only).
MIN_PIXELS, MAX_PIXELS = 200, 10000


def add_parser(sub) -> None:
    p = add_command(sub, "plot", "plot loss, lr, grad norm, tokens/s and memory of runs", __doc__)
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
    if not (MIN_PIXELS <= args.width <= MAX_PIXELS and MIN_PIXELS <= args.height <= MAX_PIXELS):
        raise UserError(f"--width {args.width} --height {args.height}: give {MIN_PIXELS} to {MAX_PIXELS} pixels each")
    plot_runs([Path(r) for r in args.runs], out, args.width, args.height)
    print(out)
    return 0
