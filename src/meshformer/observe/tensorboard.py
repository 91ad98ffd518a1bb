"""TensorBoard scalars of every metric (MindSpore's `tensorboard.tensorboard_dir`; `report_to: tensorboard`, the
default; metrics rank only).

Each numeric field of a metrics.jsonl record becomes the scalar of the same name at global step `step`, so the two
agree value for value (TensorBoard stores 32-bit floats: equal to float32 precision). The resolved config is a text
summary, the run summary another, at the last step.
"""

from __future__ import annotations

import json


class TensorBoardTracker:
    def __init__(self):
        self.writer = None
        self.step = 0

    def open(self, run) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=run.options["tensorboard_dir"], max_queue=run.options["queue"])
        if run.resume_id is None:
            self.writer.add_text("config", _as_markdown(run.config), 0)
        return None  # event files need no id: a resumed run appends a new file to the same directory

    def log(self, step: int, values: dict) -> None:
        self.step = step
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.writer.add_text(
                "run_summary", _as_markdown({k: v for k, v in summary.items() if k != "config"}), self.step
            )
        self.writer.close()

    def abandon(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _as_markdown(tree: dict) -> str:
    """A JSON block (TensorBoard renders text as markdown)."""
    return "```\n" + json.dumps(tree, indent=1, default=str) + "\n```"
