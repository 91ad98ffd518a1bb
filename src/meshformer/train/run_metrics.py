"""The trainer's metrics component: each step's record and where it goes.

The record (metrics.jsonl, train/metrics.py) holds the loss, the learning rate, the gradient norm, throughput and
MFU, the step time by phase (observe/timing.py), the memory breakdown (train/memory.py, whose meter is one of the
step's hooks), the run's skip and rollback counts and each auxiliary loss as `aux_loss/<name>`. The same record
feeds the experiment trackers (TensorBoard, W&B, MLflow, SwanLab: `report_to`, every numeric field a scalar), the
profiler window and the journal line (observe/run.py) and the console's line every `per_print_times` steps. The
hooks' `step_metrics` (train/hooks.py) join the record: an MoE model's `moe/imbalance/layerN`, `moe/dropped/layerN`
and `moe/imbalance_max` (train/moe_balance.py). Nothing here is resumed: a resumed run's metrics.jsonl is cut back
to the checkpoint's step, and the rest is counted again.
"""

from __future__ import annotations

from pathlib import Path

from meshformer.backends.peaks import peak_flops
from meshformer.config.schema import MeshformerConfig
from meshformer.dtypes import DTYPE
from meshformer.models.registry import family_of
from meshformer.observe.run import RunObservers
from meshformer.parallel import ParallelEnv
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.train import metrics as M
from meshformer.train.memory import MemoryMeter
from meshformer.train.preference_step import trains_preferences
from meshformer.train.progress import Progress
from meshformer.train.step import StepResult

AUX_PREFIX = "aux_loss/"


class RunMetrics:
    def __init__(self, cfg: MeshformerConfig, env: ParallelEnv, out: Path, plan: BatchPlan, console: Progress):
        self.cfg, self.env, self.out, self.plan, self.console = cfg, env, out, plan, console
        mons = {c.type: c for c in cfg.callbacks}
        self.print_every = mons["MFLossMonitor"].per_print_times if "MFLossMonitor" in mons else 1
        self.resume_step: int | None = None  # a resumed run: metrics.jsonl keeps what was logged up to here
        self.first: dict | None = None
        self.last: dict = {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.resume_step = int(state["step"])

    def start(self, parts, optimizer, counts: tuple[int, int, int], total_steps: int) -> MemoryMeter:
        """Open the log and the observers, say what runs; returns the memory meter (a hook for the steps).
        counts: the model's parameters, trainable parameters and input-embedding parameters."""
        cfg, env, plan = self.cfg, self.env, self.plan
        n_params, n_trainable, _ = counts
        self.total_steps = total_steps
        self.log = M.MetricsLog(self.out, env.is_metrics_rank, self.resume_step)
        self.observers = RunObservers(cfg, env, self.out, self.console.log, resuming=self.resume_step is not None)
        mc = cfg.model.model_config
        self.peak, peak_src = peak_flops(env.device, DTYPE[mc.compute_dtype], cfg.monitor_config.peak_flops)
        self.fpt = family_of(mc).flops_per_token(mc)
        rows_per_sample = 2 if trains_preferences(cfg) else 1  # a preference sample is two rows
        self.tokens_per_step = plan.global_batch * rows_per_sample * mc.seq_length
        self.console.log(
            f"model {n_params / 1e6:.2f}M parameters"
            + (f" ({n_trainable:,} trainable)" if n_trainable != n_params else "")
            + f", {self.fpt / 1e6:.1f} MFLOP/token; "
            f"{plan.describe(cfg, env.dims)}; {total_steps} steps; peak {self.peak / 1e12:.3f} TFLOP/s "
            f"per device ({peak_src}); world size {env.world_size}"
        )
        self.memory = MemoryMeter(env, parts, optimizer)  # the breakdown by component (train/memory.py)
        return self.memory

    def step_context(self, step: int):
        """What step `step` (1 for the first) runs in: the profile window, or the probe on a logging step."""
        return self.observers.step(step, self._prints(step), self.total_steps)

    def _prints(self, step: int) -> bool:
        return step % self.print_every == 0 or step == self.total_steps

    def record(self, done: int, result: StepResult, lr: float, dt: float, clock, counts: dict, scale: dict) -> dict:
        """Step `done`'s metrics.jsonl record. counts: the run's skip and rollback counts; scale: the loss scale
        the step ran at, when there is one to report."""
        plan = self.plan
        return {
            "step": done,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens_per_s": self.tokens_per_step / dt,
            "samples_per_s": plan.global_batch / dt,
            "mfu": self.fpt * self.tokens_per_step / dt / (self.peak * self.env.world_size),
            "step_time_s": dt,
            **clock.breakdown(dt),
            **self.observers.comm_time(),
            **self.memory.record(),
            **counts,
            **scale,
            **{AUX_PREFIX + name: value for name, value in result.aux_losses.items()},
            **result.metrics,
        }

    def write(self, rec: dict) -> None:
        """Into metrics.jsonl and the observers; every rank's memory breakdown after a measured step."""
        self.log.write(rec)
        self.observers.write(rec)
        self.memory.write_report(self.out, rec)

    def show(self, rec: dict) -> None:
        """The console's progress (and its line every per_print_times steps) for a step that stands."""
        self.first, self.last = self.first or rec, rec
        self.console.step(rec["step"], rec, print_now=self._prints(rec["step"]))

    def roll_back(self, step: int) -> None:
        """The run went back to `step`: what was logged after it no longer happened."""
        self.log.truncate(step)
        self.observers.roll_back(step)

    def close(self) -> None:
        """The loop ended: stop the bar and the observers, say how the loss went."""
        self.console.stop()
        self.observers.close()
        if self.first is not None:
            self.console.log(
                f"loss {self.first['loss']:.4f} (step {self.first['step']}) -> {self.last['loss']:.4f} "
                f"(step {self.last['step']}); metrics in {self.out / 'metrics.jsonl'}"
            )

    def abandon(self) -> None:
        """The run failed: the trackers' runs are marked failed (a no-op before the observers opened)."""
        if hasattr(self, "observers"):
            self.observers.abandon()

    def finish(self) -> None:
        """run_summary.json and the journal line (metrics rank)."""
        where = self.observers.finish(self.cfg, self.env.dims, self.plan.global_batch)
        if where is not None:
            self.console.log(f"journal: {where} (meshformer journal {where.parent})")
