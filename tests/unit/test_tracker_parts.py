"""report_to's spellings, the numbers a tracker is given, the registry's names, and a tracker's thread (ordered calls,
one warning on failure, a hung tracker never holding up the step), with no tracker package."""

from __future__ import annotations

import math

import pytest

from conftest import EMPTY
from meshformer.config import load_config
from meshformer.config.tracker_schema import TRACKERS, report_to_names
from meshformer.errors import UserError
from meshformer.observe.trackers import REGISTRY, tracker_values


@pytest.mark.parametrize(
    "given, names",
    [
        (["tensorboard"], ["tensorboard"]),
        ("wandb", ["wandb"]),
        ("swanlab, WandB", ["wandb", "swanlab"]),  # Hugging Face's comma string; TRACKERS' order
        (["mlflow", "mlflow"], ["mlflow"]),
        ("all", list(TRACKERS)),
        ("none", []),
        ([], []),
    ],
)
def test_report_to_spellings(given, names):
    assert report_to_names(given) == names


def test_report_to_defaults_to_tensorboard_and_loads_from_the_command_line():
    assert load_config(EMPTY).report_to == ["tensorboard"]
    assert load_config(EMPTY, ["--report_to", "[wandb, mlflow]"]).report_to == ["wandb", "mlflow"]
    with pytest.raises(UserError, match="did you mean 'swanlab'"):
        load_config(EMPTY, ["--report_to", "swanlb"])


def test_every_named_tracker_is_built_by_the_registry():
    assert tuple(REGISTRY) == TRACKERS


def test_a_tracker_gets_every_number_of_the_row_but_the_step():
    row = {"step": 3, "loss": 2.5, "tokens_per_s": 10, "eval_loss": None, "lr": math.nan, "flag": True, "note": "x"}
    assert tracker_values(row) == {"loss": 2.5, "tokens_per_s": 10}


class _Recorder:
    """A tracker that records its calls; `fail_at` makes log raise at that step, `block` makes log wait on it."""

    def __init__(self, fail_at=None, block=None):
        self.calls, self.fail_at, self.block = [], fail_at, block

    def open(self, run):
        self.calls.append(("open", run))
        return "run-7"

    def log(self, step, values):
        if self.block is not None:
            self.block.wait()
        if step == self.fail_at:
            raise OSError("disk full")
        self.calls.append(("log", step, values))

    def finish(self, summary):
        self.calls.append(("finish", summary))

    def abandon(self):
        self.calls.append(("abandon",))


def _thread(tracker, said, ids):
    from meshformer.observe.tracker_thread import TrackerThread

    return TrackerThread("fake", lambda: tracker, "the run", said.append, lambda n, i: ids.update({n: i}))


def test_a_tracker_thread_logs_in_order_keeps_its_run_id_and_finishes():
    said, ids, tracker = [], {}, _Recorder()
    t = _thread(tracker, said, ids)
    for step in (1, 2, 3):
        t.log(step, {"loss": float(step)})
    t.finish({"loss": 3.0})
    t.join(10)
    assert not t.thread.is_alive() and said == [] and ids == {"fake": "run-7"}
    assert tracker.calls == [
        ("open", "the run"),
        *[("log", s, {"loss": float(s)}) for s in (1, 2, 3)],
        ("finish", {"loss": 3.0}),
    ]


def test_a_failing_tracker_warns_once_and_is_dropped():
    said, tracker = [], _Recorder(fail_at=2)
    t = _thread(tracker, said, {})
    for step in range(1, 6):
        t.log(step, {"loss": 1.0})
    t.finish(None)
    t.join(10)
    assert len(said) == 1 and "tracker fake failed (OSError: disk full)" in said[0], said
    assert tracker.calls[-1] == ("abandon",) and [c[1] for c in tracker.calls if c[0] == "log"] == [1]


def test_a_hung_tracker_never_holds_up_the_caller():
    import threading

    from meshformer.observe import tracker_thread

    said, gate = [], threading.Event()
    t = _thread(_Recorder(block=gate), said, {})
    for step in range(1, tracker_thread.MAX_BEHIND + 10):  # it blocks in its first log: the queue fills, then drops
        t.log(step, {"loss": 1.0})
    t.finish(None)
    t.join(0.05)
    gate.set()
    assert len(said) == 1 and f"fell {tracker_thread.MAX_BEHIND} metrics rows behind" in said[0], said


def test_only_the_metrics_rank_opens_trackers(tmp_path):
    from meshformer.observe.trackers import Trackers

    cfg = load_config(EMPTY, ["--report_to", "all", "--tensorboard.tensorboard_dir", str(tmp_path / "tb")])
    other_rank = Trackers(cfg, False, tmp_path, resuming=False, log=print)
    other_rank.write({"step": 1, "loss": 1.0})
    other_rank.finish(None)
    assert other_rank.threads == [] and list(tmp_path.iterdir()) == []
