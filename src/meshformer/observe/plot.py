"""`meshformer plot`: loss, evaluation loss, learning rate, gradient norm, throughput and memory against step, for
one run or several overlaid (matplotlib's Agg backend: no display needed). Runs that log them add a row: the
auxiliary losses (`aux_loss/*`), an MoE model's load imbalance per layer and its dropped fraction
(train/moe_balance.py)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (  # (title, metrics.jsonl keys drawn in it, scale)
    ("loss", ("loss", "eval_loss"), 1.0),
    ("learning rate", ("lr",), 1.0),
    ("gradient norm", ("grad_norm",), 1.0),
    ("tokens/s", ("tokens_per_s",), 1.0),
    ("peak memory (GiB)", ("peak_mem_bytes",), 1 / 2**30),
    ("step time breakdown (s)", ("time_data_s", "time_fwd_bwd_s", "time_optim_s", "time_other_s"), 1.0),
)
# Drawn when some run logs them; a key ending in "/" stands for every key it starts (one line each).
OPTIONAL_PANELS = (
    ("auxiliary losses", ("aux_loss/",), 1.0),
    ("MoE load imbalance (max/mean tokens per expert)", ("moe/imbalance_max", "moe/imbalance/"), 1.0),
    ("MoE dropped fraction", ("moe/dropped_mean", "moe/dropped/"), 1.0),
)


def drawn_panels(rows: list[dict]) -> list[tuple[str, list[str], float]]:
    """(title, keys, scale) of each panel drawn for these records: the fixed ones, and the optional ones logged."""
    out = [(title, list(keys), scale) for title, keys, scale in PANELS]
    for title, keys, scale in OPTIONAL_PANELS:
        found = _keys(rows, keys)
        if any(k in r for k in found for r in rows):
            out.append((title, found, scale))
    return out


def _keys(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    """The panel's keys, each prefix ("x/") expanded to the logged keys it starts, in order of appearance."""
    out: list[str] = []
    for key in keys:
        found = [k for r in rows for k in r if k.startswith(key)] if key.endswith("/") else [key]
        out += [k for k in dict.fromkeys(found) if k not in out]
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    from meshformer.errors import UserError

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl: give the output_dir of a training run")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut off by a crash
    return rows


def plot_runs(run_dirs: list[Path], output: Path, width_px: int = 1500, height_px: int = 900) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d).name or str(d), read_metrics(Path(d))) for d in run_dirs]
    panels = drawn_panels([r for _, rows in runs for r in rows])
    dpi = 100
    fig, axes = plt.subplots(-(-len(panels) // 3), 3, figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, keys, scale) in zip(axes.flat, panels):
        for name, rows in runs:
            for key in keys:
                pts = [(r["step"], r[key] * scale) for r in rows if isinstance(r.get(key), (int, float))]
                if pts:
                    xs, ys = zip(*pts)
                    label = name if len(keys) == 1 else f"{name} {key}"
                    ax.plot(xs, ys, marker="o" if key == "eval_loss" else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi)
    plt.close(fig)
    return output
