"""Console output: a rich progress bar with ETA on a terminal, plain log lines otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import (
    Progress as RichProgress,
)


def format_record(rec: dict) -> str:
    parts = [f"step {rec['step']}", f"loss {rec['loss']:.4f}"]
    if "eval_loss" in rec:
        parts.append(f"eval_loss {rec['eval_loss']:.4f}")
    parts += [
        f"lr {rec['lr']:.2e}",
        f"grad_norm {rec['grad_norm']:.3f}",
        f"{rec['tokens_per_s']:.0f} tok/s",
        f"{rec['samples_per_s']:.2f} samples/s",
        f"mfu {100 * rec['mfu']:.1f}%",
        f"mem {rec['peak_mem_bytes'] / 2**20:.0f} MiB",
    ]
    return " | ".join(parts)


class Progress:
    def __init__(self, mode: str, enabled: bool = True):
        self.enabled = enabled
        self.rich = enabled and (mode == "rich" or (mode == "auto" and sys.stdout.isatty()))
        self.console = Console(highlight=False) if self.rich else None
        self.bar, self.task = None, None

    def log(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.console is not None:
            self.console.print(msg)
        else:
            print(msg, flush=True)

    def start(self, total: int, done: int) -> None:
        if self.rich:
            self.bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task("train", total=total, completed=done, info="")

    def step(self, done: int, rec: dict, print_now: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=f"loss {rec['loss']:.4f}")
        if print_now:
            self.log(format_record(rec))

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
