"""Weights & Biases (`report_to: wandb`; `pip install 'meshformer[wandb]'`).

W&B's own environment variables apply (WANDB_MODE=offline for a run with no network, WANDB_PROJECT, WANDB_ENTITY,
WANDB_DIR, WANDB_API_KEY, ...); tracker_config.project and run_name win over them. The run's history has every
metrics.jsonl field at its step, the config is the resolved config, the summary the run summary. A resumed run
continues the W&B run of the id kept in trackers.json (resume="allow"). W&B's console capture is off: meshformer's
own log is the console.
"""

from __future__ import annotations

import uuid


class WandbTracker:
    def __init__(self):
        self.run = None

    def open(self, run) -> str:
        import wandb

        where = run.dir_or("WANDB_DIR")
        if where is not None:
            where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=run.project_or("WANDB_PROJECT"),
            name=run.name,
            id=run.resume_id or uuid.uuid4().hex[:12],
            resume="allow",
            dir=None if where is None else str(where),
            config=run.config,
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )
        return self.run.id

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.items() if k != "config"})
        self.run.finish()

    def abandon(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
