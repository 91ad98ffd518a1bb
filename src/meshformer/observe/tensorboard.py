"""TensorBoard scalars of every metric (MindSpore's `tensorboard.tensorboard_dir`; metrics rank only).

Each numeric field of a metrics.jsonl record becomes the scalar of the same name at global step `step`, so the two
agree value for value (TensorBoard stores 32-bit floats: equal to float32 precision).
"""

from __future__ import annotations

import math


class TensorBoardSink:
    def __init__(self, log_dir: str, enabled: bool, queue_size: int = 10):
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def write(self, record: dict) -> None:
        if self.writer is None:
            return
        step = int(record["step"])
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
