"""MLflow (`report_to: mlflow`; `pip install 'meshformer[mlflow]'`, MLflow's lean client mlflow-skinny).

MLFLOW_TRACKING_URI says where runs go (a tracking server, or a `file:` store); without it, and always when
tracker_config.dir is set, the run goes to a file store in {dir or output_dir}/mlruns: no network, no database
(mlflow-skinny has no SQLite backend, MLflow's own default). MLflow keeps its file store only behind
MLFLOW_ALLOW_FILE_STORE, which a file store here sets when it is not set. The experiment is tracker_config.project,
else MLFLOW_EXPERIMENT_NAME, else meshformer. Every metrics.jsonl field is a metric at its step, the flattened
config the run's parameters (MLflow keeps a parameter's first value: a resumed run adds only new ones), the run
summary an artifact (run_summary.json).
"""

from __future__ import annotations

import os
import time

# MLflow's limits: parameters per log_batch call, characters of a parameter's value.
PARAMS_PER_CALL = 100
PARAM_CHARS = 6000


class MlflowTracker:
    def __init__(self):
        self.client = None
        self.run_id = None

    def open(self, run) -> str:
        from mlflow.tracking import MlflowClient

        from meshformer.observe.journal import flatten

        uri = os.environ.get("MLFLOW_TRACKING_URI") if run.dir is None else None
        if not uri:
            store = (run.dir or run.output_dir) / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri = store.resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=uri)
        known: dict = {}
        if run.resume_id is not None:
            self.run_id = run.resume_id
            known = client.get_run(self.run_id).data.params
            client.update_run(self.run_id, status="RUNNING")
        else:
            name = run.project_or("MLFLOW_EXPERIMENT_NAME")
            experiment = client.get_experiment_by_name(name)
            eid = experiment.experiment_id if experiment is not None else client.create_experiment(name)
            self.run_id = client.create_run(eid, run_name=run.name).info.run_id
        self._log_params({k: v for k, v in flatten(run.config).items() if k not in known})
        return self.run_id

    def _log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[i : i + PARAMS_PER_CALL])

    def log(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.client.log_dict(self.run_id, summary, "run_summary.json")
        self.client.set_terminated(self.run_id)

    def abandon(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED")
