"""Experiment trackers (report_to) against their own files: W&B offline (its .wandb records), MLflow's file store
(MlflowClient), SwanLab offline (its own record reader) and TensorBoard hold every metrics.jsonl value step for step
(train, eval and MoE fields);
a resumed run continues the same tracker runs; a tracker that fails is one warning and changes nothing else."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from conftest import tiny_overrides
from meshformer.config import load_config
from meshformer.train.trainer import run_training

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("swanlab")

OFFLINE = {"WANDB_MODE": "offline", "SWANLAB_MODE": "offline"}
# A tiny MoE model, so the rows hold the MoE fields too (aux_loss/..., moe/imbalance/layerN, moe/dropped/layerN).
MOE = "model.model_config.moe_config."
TINY_MOE = {
    "model.model_config.type": "Qwen3MoeConfig", MOE + "expert_num": 4, MOE + "num_experts_chosen": 2,
    MOE + "moe_intermediate_size": 16, MOE + "aux_loss_types": "[sequence]", MOE + "aux_loss_factors": "[0.01]",
    MOE + "capacity_factor": 1.0,
}  # fmt: skip


@pytest.fixture
def offline(monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    for k in ("MLFLOW_TRACKING_URI", "WANDB_DIR", "SWANLAB_LOG_DIR", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(k, raising=False)


def train(dataset, out: Path, extra: dict) -> list[dict]:
    run_training(load_config(None, tiny_overrides(dataset, out, extra)))
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def charted(rows: list[dict]) -> dict:
    """{step: {key: value}} of metrics.jsonl's numbers, what every tracker must hold."""
    return {r["step"]: {k: v for k, v in r.items() if k != "step" and type(v) in (int, float)} for r in rows}


def test_each_tracker_holds_metrics_jsonl_step_for_step_and_a_resume_continues_its_run(tiny_dataset, tmp_path, offline):
    out = tmp_path / "run"
    common = {"report_to": "[wandb, mlflow, swanlab, tensorboard]", "tensorboard.tensorboard_dir": str(out / "tb")}
    common |= {"eval_config.eval_interval": 2, "tracker_config.project": "trackers-test", "run_name": "tiny"}
    first = train(tiny_dataset, out, {**TINY_MOE, **common, "runner_config.stop_step": 4})
    ids = json.loads((out / "trackers.json").read_text())
    assert sorted(ids) == ["mlflow", "swanlab", "wandb"]
    fields = set(charted(first)[4])  # eval and MoE fields travel with the train fields
    assert {
        "eval_loss",
        "aux_loss/moe_sequence",
        "moe/imbalance/layer1",
        "moe/dropped/layer0",
        "moe/dropped_mean",
    } <= fields
    rows = train(tiny_dataset, out, {**TINY_MOE, **common, "runner_config.stop_step": 6, "resume_training": True})
    assert json.loads((out / "trackers.json").read_text()) == ids  # the same tracker runs, continued
    want = charted(rows)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]

    assert wandb_history(out, ids["wandb"]) == want
    assert mlflow_history(out, ids["mlflow"]) == want
    assert swanlab_history(out, ids["swanlab"]) == want
    tb = tensorboard_history(out / "tb")
    assert sorted(tb) == sorted(want)
    for step, values in want.items():
        assert tb[step] == pytest.approx(values, rel=1e-6), step  # TensorBoard keeps float32

    summary = json.loads((out / "run_summary.json").read_text())
    params, logged_summary = mlflow_params_and_summary(out, ids["mlflow"])
    assert params["runner_config.stop_step"] == "4"  # MLflow keeps a parameter's first value
    assert params["tracker_config.project"] == "trackers-test" and params["report_to"].startswith("[")
    assert logged_summary == json.loads(json.dumps(summary, default=str))
    assert swanlab_config(out, ids["swanlab"])["run_summary"]["loss"] == summary["loss"]


def test_a_tracker_that_fails_is_one_warning_and_changes_nothing(tiny_dataset, tmp_path, offline, monkeypatch, capsys):
    base = train(tiny_dataset, tmp_path / "base", {"runner_config.stop_step": 3, "report_to": "none"})
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("trackers cannot make a directory below a file")
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # the package gone at run time
    capsys.readouterr()
    broken = train(
        tiny_dataset,
        tmp_path / "broken",
        {
            "runner_config.stop_step": 3,
            "report_to": "wandb,mlflow,swanlab",
            "tracker_config.dir": str(in_the_way / "trackers"),  # MLflow's and SwanLab's files: unwritable
        },
    )
    printed = capsys.readouterr().out
    assert [r["loss"] for r in broken] == [r["loss"] for r in base]
    for name in ("wandb", "mlflow", "swanlab"):
        assert printed.count(f"warning: tracker {name} ") == 1, printed
    assert printed.count("warning: tracker") == 3, printed


class _FailsAtStep3:
    """A training hook that ends the run with an error at step 3."""

    def before_optimizer_step(self, step):
        if step == 3:
            raise RuntimeError("a fault at step 3")


def test_a_run_that_fails_marks_its_tracker_run_failed(tiny_dataset, tmp_path, offline):
    out = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(tiny_dataset, out, {"runner_config.stop_step": 5, "report_to": "mlflow"}))
    with pytest.raises(RuntimeError, match="a fault at step 3"):
        run_training(cfg, hooks=[_FailsAtStep3()])
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    run = _mlflow(out).get_run(run_id)
    assert run.info.status == "FAILED"
    assert [m.step for m in _mlflow(out).get_metric_history(run_id, "loss")] == [1, 2]


# ---- reading each tracker's own files ---------------------------------------------------------------------------


def wandb_history(root: Path, run_id: str) -> dict:
    """{step: {key: value}} from every .wandb file of run_id (a resumed offline run writes a second one): W&B's own
    record schema (wandb.proto), in the LevelDB log framing its writer uses (wandb 0.31 ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2

    rows: dict = {}
    files = sorted(root.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2, files  # the first run and its resumption
    for path in files:
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        for payload in leveldb_records(data):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(payload)
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                rows.setdefault(items["_step"], {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def leveldb_records(data: bytes, block: int = 32768):
    """The records of a LevelDB-format log after its 7-byte file header: chunks with a 7-byte header (crc32, length,
    type: 1 full, 2 first, 3 middle, 4 last) that never straddle a 32 KiB block (a shorter tail is padding)."""
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield parts
            parts = b""


def _mlflow(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=(root / "mlruns").resolve().as_uri())


def mlflow_history(root: Path, run_id: str) -> dict:
    client = _mlflow(root)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert client.get_experiment(run.info.experiment_id).name == "trackers-test"
    rows: dict = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run_id, key):
            assert m.key not in rows.get(m.step, {}), (key, m.step)  # each step logged once
            rows.setdefault(m.step, {})[key] = m.value
    return rows


def mlflow_params_and_summary(root: Path, run_id: str) -> tuple[dict, dict]:
    client = _mlflow(root)
    where = client.download_artifacts(run_id, "run_summary.json", str(root / "summary_download"))
    return client.get_run(run_id).data.params, json.loads(Path(where).read_text())


def _swanlab_records(root: Path, run_id: str):
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    files = sorted(root.glob(f"swanlog/run-*-{run_id}/run-{run_id}.swanlab"))
    assert len(files) == 2, files
    for path in files:
        reader = DataStoreReader()
        reader.open(path)
        for data in reader:
            rec = Record()
            rec.ParseFromString(data)
            yield rec


def swanlab_history(root: Path, run_id: str) -> dict:
    rows: dict = {}
    for rec in _swanlab_records(root, run_id):
        if rec.WhichOneof("record_type") == "scalar":
            rows.setdefault(rec.scalar.step, {})[rec.scalar.key] = rec.scalar.value.number
    return rows


def swanlab_config(root: Path, run_id: str) -> dict:
    import yaml

    newest = sorted(root.glob(f"swanlog/run-*-{run_id}/files/config.yaml"))[-1]
    config = yaml.safe_load(newest.read_text())
    return {k: (v["value"] if isinstance(v, dict) and "value" in v else v) for k, v in config.items()}


def tensorboard_history(tb: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows: dict = {}
    for path in sorted(tb.glob("events.out.tfevents.*")):  # a resumed run adds a second event file
        acc = EventAccumulator(str(path))
        acc.Reload()
        for key in acc.Tags()["scalars"]:
            for e in acc.Scalars(key):
                rows.setdefault(e.step, {})[key] = e.value
    return rows
