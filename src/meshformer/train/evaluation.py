"""The trainer's evaluation component: the validation loss on its schedule, and early stopping on it; with
eval_config.tasks, lm-evaluation-harness tasks on the same schedule (train/benchmarks.py), logged beside it.

`eval_config.eval_interval` steps apart, and after the last step with `do_eval`; each evaluation runs train/step.py's
`evaluate` (the parity suite's too) over the first `eval_iters` validation batches, a fixed order, so the losses
compare across steps. Early stopping's best loss and count are its part of trainer_state.json.
"""

from __future__ import annotations

from collections.abc import Callable

from meshformer.config.schema import MeshformerConfig
from meshformer.parallel import ModelParts, ParallelEnv
from meshformer.train.data import TrainingData
from meshformer.train.early_stop import EarlyStopping
from meshformer.train.precomputed_reference import PrecomputedReference
from meshformer.train.preference_step import PreferenceObjective
from meshformer.train.step import evaluate


class Evaluation:
    def __init__(
        self,
        cfg: MeshformerConfig,
        env: ParallelEnv,
        data: TrainingData,
        log: Callable[[str], None],
        objective: PreferenceObjective | None = None,
    ):
        """objective: a preference run's (train/preference_step.py): validation on pairs, with TRL's metrics."""
        self.cfg, self.env, self.data, self.log = cfg, env, data, log
        self.objective = objective
        self.early = EarlyStopping(cfg.runner_config.early_stopping_patience)
        self.benchmarks = None
        if cfg.eval_config.tasks:  # lm-eval is imported (and every task checked) only when tasks are asked for
            from meshformer.train.benchmarks import TrainingBenchmarks

            self.benchmarks = TrainingBenchmarks(cfg, data.tokenizer_bytes, data.tokenizer_side_files)

    def state_dict(self) -> dict:
        return self.early.state()

    def load_state_dict(self, state: dict) -> None:
        self.early = EarlyStopping(self.cfg.runner_config.early_stopping_patience, state)

    def due(self, done: int) -> bool:
        every = self.cfg.eval_config.eval_interval
        return (every > 0 and done % every == 0) or (self.cfg.do_eval and done == self.data.total_steps)

    def evaluate(self, parts: ModelParts) -> float:
        """Mean token loss over eval_iters validation batches (fixed order, so comparable across steps); a
        preference run's: the mean preference loss over the validation pairs."""
        return self.evaluate_with_metrics(parts)["loss"]

    def evaluate_with_metrics(self, parts: ModelParts) -> dict[str, float]:
        """{"loss": the validation loss} and, for a preference run, TRL's metrics over the validation pairs."""
        batches = self.data.eval_iter(self.cfg.eval_config.eval_iters)
        if self.objective is not None:
            reference = self.objective.reference
            if isinstance(reference, PrecomputedReference):  # each batch's stored rows, by its pairs' indices
                batches = reference.selecting("validation", batches, self.data.eval_batches.sample_ids)
            return self.objective.evaluate(parts, batches, self.data.eval_micro_batch)
        ignore = self.cfg.model.model_config.ignore_token_id
        return {"loss": evaluate(parts, self.env, batches, self.data.eval_micro_batch, ignore)}

    def after_step(self, done: int, parts: ModelParts, rec: dict) -> bool:
        """Evaluate when due (into rec["eval_loss"], and each task's rec["eval/<task>/<metric>"]); True when that
        is the best loss so far and early stopping is on (the trainer then saves a checkpoint marked best)."""
        if not self.due(done):
            return False
        if self.benchmarks is not None:
            rec.update(self.benchmarks.run(parts, self.env))
        if self.data.eval_ds is None:
            return False
        got = self.evaluate_with_metrics(parts)
        rec["eval_loss"] = got.pop("loss")
        rec.update({f"eval_{name}": value for name, value in got.items()})  # TRL's eval_rewards/chosen, ...
        return self.early.update(rec["eval_loss"]) and self.early.enabled

    def should_stop(self, done: int) -> bool:
        """Early stopping's patience ran out (said on the console)."""
        if not self.early.should_stop:
            return False
        self.log(
            f"early stopping after step {done}: no better validation loss in {self.early.patience} "
            f"evaluations (best {self.early.best:.4f}, kept in the checkpoint marked best)"
        )
        return True
