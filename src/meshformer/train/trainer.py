"""The training loop: config in; trained weights, metrics.jsonl and checkpoints out.

The loop knows nothing about the layout: `meshformer.parallel` hands it a ParallelEnv (ranks, reductions)
and ModelParts (forward/backward over this rank's part). One optimizer step consumes exactly one global
batch, so "global batch b" and "step b" are the same number, and resuming needs only the step.

The Trainer composes components that each keep their own state and hand it to trainer_state.json through
`state_dict()` / `load_state_dict(state)`: data (train/data.py), checkpoints and rollbacks (train/checkpointing.py),
evaluation and early stopping (train/evaluation.py), skipped steps (train/skips.py), metrics and observers
(train/run_metrics.py), loss scaling (train/loss_scale.py). Hooks (train/hooks.py) run inside every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import yaml

from meshformer.checkpoint import store
from meshformer.checkpoint.store import BASE_KEY, recorded_base
from meshformer.config.load import to_dict
from meshformer.config.schema import MeshformerConfig
from meshformer.errors import RunFailed, UserError
from meshformer.models import num_params
from meshformer.models.init import canonical_name
from meshformer.observe.timing import StepClock
from meshformer.parallel import ModelParts, ParallelEnv, init_parallel
from meshformer.parallel.batch_plan import BatchPlan
from meshformer.train import (
    float8_scales,  # noqa: F401  (registers fp8_config's precomputed FSDP scales)
    moe_balance,  # noqa: F401  (registers the MoE balance hook every MoE run needs)
)
from meshformer.train.base_source import BaseModelSource, source_of
from meshformer.train.checkpointing import Checkpointing, check_resumable, run_identity
from meshformer.train.data import TrainingData
from meshformer.train.distill_step import DistillObjective
from meshformer.train.distill_teacher import build_teacher
from meshformer.train.evaluation import Evaluation
from meshformer.train.finetune import apply_finetune_base
from meshformer.train.hooks import Hooks, registered_hooks
from meshformer.train.loading import check_tokenizer, load_base_weights
from meshformer.train.loss_scale import LossScaler
from meshformer.train.optim import Optimizers, Schedule
from meshformer.train.precomputed_reference import PrecomputedReference, reference_for_run
from meshformer.train.preemption import StopRequests, stop_signals_held
from meshformer.train.preference_step import PreferenceObjective
from meshformer.train.progress import Progress
from meshformer.train.run_dir import RunDir
from meshformer.train.run_metrics import RunMetrics
from meshformer.train.skips import SkippedSteps
from meshformer.train.spikes import SpikeDetector
from meshformer.train.step import StepResult, build_parts, build_reference, clip_threshold, train_step

# trainer_state.json: the weights a preference run started from, which its frozen reference reloads on a resume
REFERENCE_KEY = "preference_reference_weights"


class Trainer:
    def __init__(
        self,
        cfg: MeshformerConfig,
        notices: list[str] | None = None,
        env: ParallelEnv | None = None,
        hooks: Iterable = (),
        sources: Sequence[BaseModelSource] = (),
    ):
        """hooks: train/hooks.py objects every step calls, before the registered ones (register_hook). sources:
        the models from outside load_checkpoint may name (train/base_source.py; the CLI's: a Hugging Face
        directory)."""
        self.cfg = cfg
        self.sources = tuple(sources)
        self.mc = cfg.model.model_config
        self.out = Path(cfg.output_dir)
        self.env = env or init_parallel(cfg)
        self.console = Progress(cfg.monitor_config.progress_bar, enabled=self.env.is_metrics_rank)
        for n in notices or []:
            self.console.log(f"note: {n}")
        self.plan = BatchPlan.from_config(cfg, self.env.dims)
        self.data = TrainingData(cfg, self.env, self.plan, self.console.log)
        self.total_steps = self.data.total_steps
        self.run_dir = RunDir(self.out, self.env, self.console.log)
        self.run_dir.lock()
        try:
            # auto (for restarts): resume when a good checkpoint exists, else start over, replacing (safely)
            # whatever an attempt that died before its first checkpoint left; checkpoints that are all
            # unusable are refused, not replaced (train/run_dir.py).
            replace = cfg.overwrite_output_dir or cfg.resume_training == "auto"
            self.resume_from = self.run_dir.find_resume(
                cfg.resume_training, cfg.load_checkpoint, cfg.overwrite_output_dir
            )
            self._replaces_old_run = self.run_dir.check_existing(self.resume_from, replace)
            self._build_model()
            self.checkpoints = Checkpointing(cfg, self.env, self.out, self.run_dir, self.console.log)
            self.hooks = [*hooks, *registered_hooks(cfg, self.parts)]
            self._start_state()
        except BaseException:
            if hasattr(self, "checkpoints"):
                self.checkpoints.saver.close()
            self.run_dir.unlock()
            raise

    # ---- set-up -------------------------------------------------------------------------------------------
    def _build_model(self) -> None:
        cfg = self.cfg
        run_tokens = self.total_steps * self.plan.global_batch * self.mc.seq_length
        built = build_parts(cfg, self.env, run_tokens=run_tokens)
        for name in built.transforms:
            self.console.log(f"model transform: {name}")
        self.console.log(built.parts.compile_note)
        if built.parts.fp8_note:
            self.console.log(built.parts.fp8_note)
        if built.parts.cp_note is not None:
            self.console.log(built.parts.cp_note)
        if built.matmul_note:
            self.console.log(built.matmul_note)
        self.n_params = num_params(built.model)
        self.n_trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
        # The input embedding is a lookup, not a matmul; a tied head does matmul work, so count it then.
        self.n_embedding = 0 if self.mc.tie_word_embeddings else built.model.embed_tokens.weight.numel()
        self.parts: ModelParts = built.parts
        # What a checkpoint must hold for this model: every tensor by name and global shape, nothing else.
        # (by checkpoint names: a compiled or recomputed layer's wrappers are not part of them)
        self.expected_shapes = {canonical_name(k): tuple(v.shape) for k, v in built.model.state_dict().items()}
        self.optimizer = Optimizers(self.parts.parts, cfg)
        self.schedule = Schedule(self.optimizer, cfg, self.total_steps)
        self.objective = built.objective  # a preference run's loss with its frozen reference, or distillation's
        if isinstance(self.objective, PreferenceObjective):
            self.objective.reference = build_reference(cfg, self.env, self.parts)
        elif self.objective is not None:  # the teacher: built as the student, loaded from distill_config.teacher
            self.objective.teacher = build_teacher(cfg, self.env, self.sources)

    def _start_state(self) -> None:
        """The components at step 0, then the checkpoint to resume from or the weights to start from."""
        cfg, log = self.cfg, self.console.log
        self.start_step = 0
        pairs = self.objective if isinstance(self.objective, PreferenceObjective) else None  # validation on pairs
        self.evaluation = Evaluation(cfg, self.env, self.data, log, pairs)
        self.skips = SkippedSteps(cfg.runner_wrapper.max_consecutive_skips, log)
        self.scaler = LossScaler.from_config(cfg)  # fp16: dynamic loss scaling (train/loss_scale.py)
        self.metrics = RunMetrics(cfg, self.env, self.out, self.plan, self.console)
        self.hf_base = None  # the Hugging Face model the weights came from, for an exported adapter's config
        self.reference_start = None  # where a preference reference's weights come from (None: the seed's init)
        if self.resume_from is not None:
            self._restore(self.resume_from)
        elif cfg.load_checkpoint:
            self._load_base_weights(Path(cfg.load_checkpoint))
        self._start_reference()

    @property
    def reference(self):
        """A preference run's reference (train/frozen_model.py FrozenModel or a PrecomputedReference), else None."""
        return self.objective.reference if isinstance(self.objective, PreferenceObjective) else None

    def _start_reference(self) -> None:
        """A `reference: copy` holds the run's starting weights: the policy's before its first step; on a resume,
        those the run started from (trainer_state.json's REFERENCE_KEY: its load_checkpoint), else the seed's
        initialisation, which the policy started from too."""
        preference = isinstance(self.objective, PreferenceObjective)
        if preference and self.cfg.preference_config.reference_kind() == "precomputed":
            resuming = self.resume_from is not None
            self.objective.reference = reference_for_run(
                self.cfg, self.data, self.parts, self.objective, resuming, self.out, self.console.log
            )
            return
        reference = self.reference
        if reference is None or not reference.owns_weights:
            return
        if self.resume_from is None:
            self.reference_start = self.cfg.load_checkpoint or None
            reference.copy_weights_from(self.parts)
        elif self.reference_start:
            src = Path(self.reference_start)
            load_base_weights(
                src, source_of(src, self.sources), self.cfg, reference.parts.parts, self.expected_shapes,
                self.data.tokenizer_hash, self.run_dir,
            )  # fmt: skip

    def _load_base_weights(self, src: Path) -> None:
        source = source_of(src, self.sources)
        where = load_base_weights(
            src, source, self.cfg, self.parts.parts, self.expected_shapes, self.data.tokenizer_hash, self.run_dir
        )
        self.console.log(f"loaded weights from {where}")
        # from the checkpoint load_base_weights resolved (rank 0, once), not resolved and hashed again here
        self.hf_base = source.base_name(src) if source is not None else recorded_base(Path(where))

    def _restore(self, ckpt: Path) -> None:
        state = store.read_trainer_state(ckpt)
        check_resumable(ckpt, state, self._identity())
        self.data.load_state_dict(state)  # refuses other training data
        check_tokenizer(ckpt, self.data.tokenizer_hash)
        base = self._nf4_base_source(ckpt, state)
        if base is not None:  # a QLoRA checkpoint holds no NF4 base (checkpoint/store.py): quantize it again
            self._load_base_weights(base)
        self.checkpoints.load(ckpt, self.parts.parts, self.optimizer.items, self.expected_shapes)
        self.load_state_dict(state)
        self.console.log(f"resumed from {ckpt} at step {self.start_step}")

    def _nf4_base_source(self, ckpt: Path, state: dict) -> Path | None:
        """Where a resumed QLoRA run's frozen base comes from: load_checkpoint when it names the base (not the
        checkpoint resumed), else the Hugging Face directory the checkpoint records; None: the seed drew it."""
        if not store.nf4_shapes(self.parts.parts):
            return None
        given = self.cfg.load_checkpoint
        if given and Path(given).resolve() not in (ckpt.resolve(), self.out.resolve(), ckpt.parent.parent.resolve()):
            return Path(given)
        recorded = state.get(BASE_KEY)
        if recorded and Path(recorded).is_dir():
            return Path(recorded)
        if given or recorded:
            raise UserError(
                f"resuming the QLoRA run in {ckpt}: its NF4 base is not saved and its source is unknown: give the "
                f"base model as load_checkpoint with resume_training: auto"
            )
        return None

    # ---- trainer_state.json -------------------------------------------------------------------------------
    def _identity(self) -> dict:
        return run_identity(self.cfg, self.plan.global_batch, self.data.tokenizer_hash)

    def state_dict(self, step: int, best: bool = False) -> dict:
        """trainer_state.json of a checkpoint at `step`: every component's part."""
        env = self.env
        return {
            "step": step,
            **self._identity(),
            "layout": {"data_parallel": env.dp_size, "model_parallel": env.tp_size, "pipeline_stage": env.pp_size},
            **self.skips.state_dict(),
            **self.checkpoints.state_dict(),
            "finite": self.skips.last_finite,  # pruning never drops the newest finite checkpoint for non-finite ones
            "best": best,  # early stopping: pruning keeps the newest checkpoint marked best
            **self.evaluation.state_dict(),
            **self.scaler.state(),
            **({BASE_KEY: self.hf_base} if self.hf_base else {}),
            **({REFERENCE_KEY: self.reference_start} if self.reference_start else {}),
            **self.data.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Every component from trainer_state.json (the data's part, a check, ran in _restore before the weights)."""
        self.start_step = int(state["step"])
        for component in (self.skips, self.checkpoints, self.evaluation, self.metrics):
            component.load_state_dict(state)
        self.scaler.load(state)
        self.hf_base = state.get(BASE_KEY)
        self.reference_start = state.get(REFERENCE_KEY)

    # ---- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict:
        self.run_dir.set_aside_damaged()  # only now, like the move below: a damaged checkpoint is never deleted
        if self._replaces_old_run:
            self.run_dir.replace_old(self.cfg.tensorboard.tensorboard_dir)  # only now: model built and loaded
        if isinstance(self.reference, PrecomputedReference):
            self.reference.save(self.out, self.env)  # with the run, once it owns output_dir
        counts = (self.n_params, self.n_trainable, self.n_embedding)
        memory = self.metrics.start(self.parts, self.optimizer, counts, self.total_steps)
        if self.reference is not None and not isinstance(self.reference, PrecomputedReference):
            memory.watch_reference(self.reference)  # its weights and its forward, beside the policy's
        if isinstance(self.objective, DistillObjective):
            memory.watch_teacher(self.objective.teacher)  # its weights, its forward and the logits it keeps
        if isinstance(self.objective, PreferenceObjective) and self.cfg.preference_config.method == "kto":
            memory.watch_kl_pass(self.objective)  # the policy's forward over the KL rows, before its step
        hooks = Hooks([memory, *self.hooks])  # memory measurement outermost: it sees what the others add
        self.parts.train()
        with StopRequests(self.cfg.runner_config.preemption_grace_seconds, self.console.log) as stop:
            end, best = self._loop(hooks, stop)
            self.metrics.close()
            if self.checkpoints.saved_at != end and (end > self.start_step or not store.list_checkpoints(self.out)):
                self.save(end, best=end > self.start_step and best)
            self.checkpoints.saver.wait()
        if self.env.is_metrics_rank:
            self.metrics.finish()
        return self.metrics.last

    def _loop(self, hooks: Hooks, stop: StopRequests) -> tuple[int, bool]:
        """Steps until the end, early stopping or a stop signal; (the last step done, whether its evaluation was
        the best so far)."""
        self.console.start(self.total_steps, self.start_step)
        spikes = SpikeDetector(self.cfg.runner_wrapper.loss_spike_factor)
        step, best = self.start_step, False
        while step < self.total_steps:
            result, lr, dt, clock, scale_used = self._run_step(step, hooks)
            done = step + 1
            if self._is_spike(spikes, step, result.loss):
                step = self._roll_back(done, result.loss, spikes)
                continue
            counts = {"skipped_steps": self.skips.total, "rollbacks": self.checkpoints.rollbacks}
            scale = {"loss_scale": scale_used} if self.scaler.dynamic or scale_used != 1.0 else {}
            rec = self.metrics.record(done, result, lr, dt, clock, counts, scale)
            best = self.evaluation.after_step(done, self.parts, rec)
            self.skips.report(done, result, scale_used, self.scaler.scale)
            self.metrics.write(rec)
            if self.skips.exhausted:
                self.console.stop()
                self.checkpoints.saver.wait()  # a save still being written is a good one: let it complete
                raise self.skips.failure(done, self.out)
            self.metrics.show(rec)
            self.env.at_step(done)
            if self._after_step(done, best, stop):
                return done, best
            step = done
        return self.total_steps, best

    def _run_step(self, step: int, hooks: Hooks) -> tuple[StepResult, float, float, StepClock, float]:
        """Step `step + 1` on its batch: (result, learning rate, seconds, its clock, the loss scale it ran at)."""
        env, plan = self.env, self.plan
        with self.metrics.step_context(step + 1):
            clock = StepClock(env.device)
            t0 = clock.start
            batch_index = step + self.checkpoints.data_offset  # > step once a rollback skipped a spike's batches
            inputs, labels, documents = self.data.train_batch(batch_index)
            if isinstance(self.reference, PrecomputedReference):
                self.reference.select("train", self.data.batches.sample_ids(batch_index))
            clock.lap("data")
            lr = self.schedule.apply(step)
            result = train_step(
                self.parts,
                self.optimizer,
                env,
                inputs,
                labels,
                n_micro=plan.n_micro,
                ignore_index=self.mc.ignore_token_id,
                max_grad_norm=clip_threshold(self.cfg),
                documents=documents,
                loss_scale=self.scaler.scale,
                clock=clock,
                hooks=hooks,
                step=step + 1,
                objective=self.objective,
            )
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)
            dt = time.perf_counter() - t0
        scale_used = self.scaler.scale
        self.scaler.update(not result.skipped)
        self.skips.count(result, self.scaler.dynamic)
        return result, lr, dt, clock, scale_used

    def _is_spike(self, spikes: SpikeDetector, step: int, loss: float) -> bool:
        spike = spikes.is_spike(step + 1, loss, after_warmup=step >= self.schedule.kw["warmup"])
        if spikes.enabled and self.env.pp_size > 1:  # only the last stage sees the loss: all ranks follow it
            spike = not self.env.all_ok(not spike)
        return spike

    def _roll_back(self, spike_step: int, loss: float, spikes: SpikeDetector) -> int:
        """Back to the newest good checkpoint, past the spike's batches (train/checkpointing.py); returns its step."""
        back, state = self.checkpoints.roll_back(
            spike_step, loss, spikes, self.parts.parts, self.optimizer.items, self.expected_shapes
        )
        self.scaler.load(state)
        self.skips.load_state_dict(state)
        self.metrics.roll_back(back)
        return back

    def _after_step(self, done: int, best: bool, stop: StopRequests) -> bool:
        """Save when due; True when the run stops after this step (early stopping, a stop signal)."""
        self.checkpoints.saver.poll()  # completes a background save once every rank has written it
        if (self.checkpoints.due(done) or best) and done < self.total_steps:
            self.save(done, best=best)
        if self.evaluation.should_stop(done):
            return True
        if stop.agreed(self.env):  # a rank was signalled (preemption): everyone saves and returns
            self.console.log(f"{stop.received}: stopping after step {done}; resume with resume_training")
            return True
        return False

    def evaluate(self) -> float:
        """Mean token loss over eval_iters validation batches (train/evaluation.py)."""
        return self.evaluation.evaluate(self.parts)

    # ---- checkpoints --------------------------------------------------------------------------------------
    @property
    def saver(self):
        return self.checkpoints.saver

    @property
    def train_ds(self):
        return self.data.train_ds

    def save(self, step: int, best: bool = False) -> None:
        """Save at `step` (complete on return, or pending in the background with async_save)."""
        files = {
            "config.yaml": yaml.safe_dump(to_dict(self.cfg), sort_keys=False).encode(),
            **({"tokenizer.json": self.data.tokenizer_bytes} if self.data.tokenizer_bytes is not None else {}),
            **self.data.tokenizer_side_files,
        }
        self.checkpoints.save(step, self.parts.parts, self.optimizer.items, self.state_dict(step, best), files)


def run_training(
    cfg: MeshformerConfig,
    notices: list[str] | None = None,
    hooks: Iterable = (),
    preflight: Iterable = (),
    sources: Sequence[BaseModelSource] = (),
) -> dict:
    """Train; a collective that fails because a rank died or hung ends the run naming that rank (RunFailed).
    hooks: train/hooks.py objects every step calls. preflight: checks `(cfg, env)` run once the layout is known,
    before the trainer opens anything (the CLI's memory floor: planner/fits.py). sources: the models from outside
    load_checkpoint may name, for the fine-tune's shape and the weights (the CLI's: interop/base_model.py)."""
    notices = [*(notices or []), *apply_finetune_base(cfg, sources)]
    env = init_parallel(cfg)
    if cfg.swap_config.swap and env.device.type != "cuda":
        notices.append("swap_config.swap: a CPU run keeps activations in host memory anyway; swap is off")
    trainer, ok = None, False
    try:
        for check in preflight:
            check(cfg, env)
        trainer = Trainer(cfg, notices, env, hooks, sources)
        last = trainer.train()
        ok = True
        return last
    except (UserError, RunFailed):  # decided on every rank alike: nothing to diagnose
        raise
    except Exception as e:
        with stop_signals_held():
            why = env.explain_failure(e)
        if why is None:
            raise
        raise RunFailed(why) from None
    finally:
        if trainer is not None:
            if not ok:
                trainer.metrics.abandon()  # the trackers' runs end as failed, not left running
            trainer.saver.close()
            trainer.data.close()  # the prefetching threads
            trainer.run_dir.unlock()
        env.shutdown(clean=ok)
