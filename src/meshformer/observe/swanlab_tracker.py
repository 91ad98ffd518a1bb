"""SwanLab (`report_to: swanlab`; `pip install 'meshformer[swanlab]'`).

SwanLab's own environment variables apply (SWANLAB_MODE=offline or local for a run with no network, SWANLAB_PROJECT,
SWANLAB_LOG_DIR, SWANLAB_API_KEY, ...); tracker_config.project and run_name win over them, and its files go to
{tracker_config.dir or output_dir}/swanlog unless SWANLAB_LOG_DIR says otherwise. Every metrics.jsonl field is a
scalar at its step, the resolved config the run's config, and the run summary joins the config as run_summary (SwanLab
has no summary of its own). A resumed run continues the SwanLab run of the id kept in trackers.json. SwanLab never
asks for a login here (a run has no one to answer) and does not capture the console.
"""

from __future__ import annotations


class SwanlabTracker:
    def __init__(self):
        self.run = None

    def open(self, run) -> str:
        import swanlab

        where = run.dir_or("SWANLAB_LOG_DIR")
        self.run = swanlab.init(
            project=run.project_or("SWANLAB_PROJECT"),
            name=run.name,
            id=run.resume_id,
            resume="allow",
            config=run.config,
            reinit=True,
            settings=swanlab.Settings(interactive=False, terminal={"proxy_type": "none"}),
            **({} if where is None else {"log_dir": str(where / "swanlog")}),
        )
        return self.run.id

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.config.update({"run_summary": {k: v for k, v in summary.items() if k != "config"}})
        self.run.finish()

    def abandon(self) -> None:
        if self.run is not None:
            self.run.finish(state="crashed")
