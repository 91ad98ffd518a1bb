"""The training loop: config in; trained weights, metrics.jsonl and checkpoints out.

The loop knows nothing about the layout: `meshformer.parallel` hands it a ParallelEnv (ranks, reductions)
and ModelParts (forward/backward over this rank's part). One optimizer step consumes exactly one global
batch, so "global batch b" and "step b" are the same number, and resuming needs only the step.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import yaml
from torch import Tensor

from meshformer.checkpoint import store
from meshformer.checkpoint.convert import BASE_KEY, hf_base_name, recorded_base
from meshformer.checkpoint.hf_dir import is_hf_dir
from meshformer.checkpoint.saver import CheckpointSaver
from meshformer.config.load import to_dict
from meshformer.config.schema import MeshformerConfig
from meshformer.data.dataset import GlobalBatches, SampleOrder, open_dataset
from meshformer.data.tokenizer import tokenizer_hash
from meshformer.dtypes import DTYPE
from meshformer.errors import RunFailed, UserError
from meshformer.models import num_params
from meshformer.observe.run import RunObservers
from meshformer.observe.timing import StepClock
from meshformer.parallel import ModelParts, ParallelEnv, init_parallel
from meshformer.planner.fits import check_fits
from meshformer.train import metrics as M
from meshformer.train.batch_plan import BatchPlan
from meshformer.train.early_stop import EarlyStopping
from meshformer.train.finetune import apply_finetune_base
from meshformer.train.loading import check_tokenizer, load_base_weights
from meshformer.train.loss_scale import LossScaler
from meshformer.train.memory import MemoryMeter
from meshformer.train.optim import Optimizers, Schedule, schedule_warnings
from meshformer.train.preemption import StopRequests, stop_signals_held
from meshformer.train.progress import Progress
from meshformer.train.run_dir import RunDir, on_rank0
from meshformer.train.spikes import MAX_ROLLBACKS, SpikeDetector
from meshformer.train.step import build_parts, clip_threshold, eval_micro_batch, evaluate, train_step


class Trainer:
    def __init__(self, cfg: MeshformerConfig, notices: list[str] | None = None, env: ParallelEnv | None = None):
        self.cfg = cfg
        self.mc = cfg.model.model_config
        self.out = Path(cfg.output_dir)
        self.env = env or init_parallel(cfg)
        self.console = Progress(cfg.monitor_config.progress_bar, enabled=self.env.is_metrics_rank)
        for n in notices or []:
            self.console.log(f"note: {n}")
        self.plan = BatchPlan.from_config(cfg, self.env.dims)
        self._open_data()
        check_fits(cfg, self.env.dims, self.env.device)  # a size typo fails here, before anything is allocated
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
            self.saver = self._make_saver()
        except BaseException:
            self.run_dir.unlock()
            raise

    # ---- set-up -------------------------------------------------------------------------------------------
    def _open_data(self) -> None:
        cfg, field = self.cfg, "train_dataset.data_loader.dataset_dir"
        if cfg.train_dataset.data_loader.type != "MindDataset":
            raise UserError(f"{field}: only MindDataset directories are supported")
        dl = cfg.train_dataset.data_loader
        self.train_ds = open_dataset(
            dl.dataset_dir, cfg.train_dataset.split or "train", self.mc.seq_length, field, dl.packing
        )
        if hasattr(self.train_ds, "padding"):
            self.console.log(
                f"instruction data: {self.train_ds.samples} samples in {len(self.train_ds)} rows of "
                f"{self.mc.seq_length + 1} tokens, {self.train_ds.padding:.1%} padding"
                + (" (packed)" if dl.packing else " (one sample per row; packing: true fills rows)")
            )
        tok = self.train_ds.dir / "tokenizer.json"
        if not tok.is_file():
            raise UserError(f"{field}: {tok} is missing: re-run `meshformer preprocess`")
        self.tokenizer_bytes = tok.read_bytes()
        # Saved with every checkpoint, so `export` hands on the special tokens and the template the data was made with.
        self.tokenizer_side_files = {
            name: (self.train_ds.dir / name).read_bytes()
            for name in ("tokenizer_config.json", "chat_template.jinja")
            if (self.train_ds.dir / name).is_file()
        }
        self.tokenizer_hash = tokenizer_hash(tok)
        self.train_ds.check_tokenizer(self.tokenizer_hash, self.mc.vocab_size, field)
        ev = cfg.eval_dataset
        self.eval_ds = None
        if cfg.do_eval or cfg.eval_config.eval_interval > 0:
            eval_dir = ev.data_loader.dataset_dir or cfg.train_dataset.data_loader.dataset_dir
            split = ev.split or "validation"
            self.eval_ds = open_dataset(
                eval_dir, split, self.mc.seq_length, "eval_dataset.data_loader.dataset_dir", ev.data_loader.packing
            )
            self.eval_ds.check_tokenizer(
                self.tokenizer_hash, self.mc.vocab_size, "eval_dataset.data_loader.dataset_dir"
            )
            self.eval_micro_batch = eval_micro_batch(cfg, self.plan.micro_batch)
            unit = self.env.dp_size * self.eval_micro_batch  # one eval micro-batch on every data-parallel rank
            if len(self.eval_ds) < unit:
                raise UserError(
                    f"eval_dataset: {len(self.eval_ds)} validation samples of seq_length {self.mc.seq_length} "
                    f"are fewer than one eval micro-batch ({self.eval_micro_batch}) per data-parallel rank "
                    f"({unit} in all): set eval_dataset.batch_size lower, add validation text (preprocess "
                    f"--val-fraction) or lower model.model_config.seq_length"
                )
            # About one training global batch per eval iteration (whole eval micro-batches), split over dp.
            eval_batch = min(max(self.plan.global_batch // unit, 1) * unit, len(self.eval_ds) // unit * unit)
            self.eval_batches = GlobalBatches(
                SampleOrder(len(self.eval_ds), 0, False), eval_batch, self.env.dp_rank, self.env.dp_size
            )
        order = SampleOrder(len(self.train_ds), self.cfg.seed, cfg.train_dataset.data_loader.shuffle)
        if order.n < self.plan.global_batch:
            raise UserError(
                f"train_dataset: {order.n} samples of seq_length {self.mc.seq_length} are fewer than one "
                f"global batch ({self.plan.describe(cfg, self.env.dims)}): add data or shrink the batch"
            )
        self.batches = GlobalBatches(order, self.plan.global_batch, self.env.dp_rank, self.env.dp_size)
        rc = cfg.runner_config
        self.total_steps = rc.stop_step or rc.epochs * self.batches.per_epoch
        for warning in schedule_warnings(cfg, self.total_steps):
            self.console.log(f"warning: {warning}")

    def _build_model(self) -> None:
        cfg = self.cfg
        run_tokens = self.total_steps * self.plan.global_batch * self.mc.seq_length
        built = build_parts(cfg, self.env, run_tokens=run_tokens)
        for name in built.transforms:
            self.console.log(f"model transform: {name}")
        self.console.log(built.parts.compile_note)
        if built.matmul_note:
            self.console.log(built.matmul_note)
        self.n_params = num_params(built.model)
        self.n_trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
        # The input embedding is a lookup, not a matmul; a tied head does matmul work, so count it then.
        self.n_embedding = 0 if self.mc.tie_word_embeddings else built.model.embed_tokens.weight.numel()
        self.parts: ModelParts = built.parts
        # What a checkpoint must hold for this model: every tensor by name and global shape, nothing else.
        self.expected_shapes = {k: tuple(v.shape) for k, v in built.model.state_dict().items()}
        self.optimizer = Optimizers(self.parts.parts, cfg)
        self.schedule = Schedule(self.optimizer, cfg, self.total_steps)
        self.start_step = 0
        self._saved_at = -1  # step of this run's newest checkpoint
        self.data_offset = 0  # global batches skipped by loss-spike rollbacks (step s reads batch s + offset)
        self.rollbacks = 0
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient norm, whole run
        self.last_finite = True
        self.early = EarlyStopping(cfg.runner_config.early_stopping_patience)
        self.scaler = LossScaler.from_config(cfg)  # fp16: dynamic loss scaling (train/loss_scale.py)
        self.hf_base = None  # the Hugging Face model the weights came from, for an exported adapter's config
        if self.resume_from is not None:
            self._restore(self.resume_from)
        elif cfg.load_checkpoint:
            self._load_base_weights(Path(cfg.load_checkpoint))

    def _load_base_weights(self, src: Path) -> None:
        where = load_base_weights(
            src, self.cfg, self.parts.parts, self.expected_shapes, self.tokenizer_hash, self.run_dir
        )
        self.console.log(f"loaded weights from {where}")
        # from the checkpoint load_base_weights resolved (rank 0, once), not resolved and hashed again here
        self.hf_base = hf_base_name(src) if is_hf_dir(src) else recorded_base(Path(where))

    def _check_ckpt_tokenizer(self, ckpt: Path) -> None:
        check_tokenizer(ckpt, self.tokenizer_hash)

    def _restore(self, ckpt: Path) -> None:
        state = store.read_trainer_state(ckpt)
        # The data position is "global batches consumed": it means the same samples only if these agree.
        for key, now in (
            ("global_batch", self.plan.global_batch),
            ("seed", self.cfg.seed),
            ("seq_length", self.mc.seq_length),
        ):
            if state.get(key, now) != now:
                raise UserError(
                    f"resume_training: {ckpt} was saved with {key}={state[key]} but this config gives "
                    f"{now}: keep {key} to resume, or start a new run from its weights with "
                    f"load_checkpoint (resume_training: false)"
                )
        self._check_ckpt_tokenizer(ckpt)
        store.load_model_weights(ckpt, self.parts.parts, self.expected_shapes)
        store.load_optimizer(ckpt, self.parts.parts, self.optimizer.items)
        self.start_step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.data_offset = int(state.get("data_offset", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.early = EarlyStopping(self.cfg.runner_config.early_stopping_patience, state)
        self.scaler.load(state)
        self.hf_base = state.get(BASE_KEY)
        self.console.log(f"resumed from {ckpt} at step {self.start_step}")

    # ---- the loop -----------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, env, plan = self.cfg, self.env, self.plan
        mons = {c.type: c for c in cfg.callbacks}
        print_every = mons["MFLossMonitor"].per_print_times if "MFLossMonitor" in mons else 1
        ckpt_cb = mons.get("CheckpointMonitor")
        if self._replaces_old_run:
            self.run_dir.replace_old(cfg.tensorboard.tensorboard_dir)  # only now: model built and loaded, data opened
        log = M.MetricsLog(self.out, env.is_metrics_rank, self.start_step if self.resume_from else None)
        self.observers = RunObservers(cfg, env, self.out, self.console.log)
        compute_dtype = DTYPE[self.mc.compute_dtype]
        peak, peak_src = M.peak_flops(env.device, compute_dtype, cfg.monitor_config.peak_flops)
        fpt = M.flops_per_token(self.mc, self.n_params, self.n_embedding)
        tokens_per_step = plan.global_batch * self.mc.seq_length
        self.console.log(
            f"model {self.n_params / 1e6:.2f}M parameters"
            + (f" ({self.n_trainable:,} trainable)" if self.n_trainable != self.n_params else "")
            + f", {fpt / 1e6:.1f} MFLOP/token; "
            f"{plan.describe(cfg, env.dims)}; {self.total_steps} steps; peak {peak / 1e12:.3f} TFLOP/s "
            f"per device ({peak_src}); world size {env.world_size}"
        )
        memory = MemoryMeter(env, self.parts, self.optimizer)  # the breakdown by component (train/memory.py)
        first, last = None, {}
        skips_in_a_row = 0
        self.parts.train()
        end = self.total_steps
        new_best = False
        with StopRequests(cfg.runner_config.preemption_grace_seconds, self.console.log) as stop:
            self.console.start(self.total_steps, self.start_step)
            spikes = SpikeDetector(cfg.runner_wrapper.loss_spike_factor)
            step = self.start_step
            while step < self.total_steps:
                logging_step = (step + 1) % print_every == 0 or step + 1 == self.total_steps
                with self.observers.step(step + 1, logging_step, self.total_steps):
                    clock = StepClock(env.device)
                    t0 = clock.start
                    batch_index = step + self.data_offset  # > step once a rollback skipped the batches of a spike
                    inputs, labels, documents = self._inputs_labels(self.train_ds, self.batches, batch_index)
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
                        max_grad_norm=clip_threshold(cfg),
                        capture=memory.capture(),
                        # after the first update gradients and optimizer states all exist
                        after_update=memory.after_update,
                        documents=documents,
                        loss_scale=self.scaler.scale,
                        clock=clock,
                    )
                    if env.device.type == "cuda":
                        torch.cuda.synchronize(env.device)
                    dt = time.perf_counter() - t0
                scale_used = self.scaler.scale
                self.scaler.update(not result.skipped)
                loss, grad_norm = result.loss, result.grad_norm
                self.skipped_steps += result.skipped
                self.last_finite = math.isfinite(loss) and math.isfinite(grad_norm)
                # An fp16 overflow under dynamic loss scaling (finite loss, gradients not) is routine, not bad data
                overflow = self.scaler.dynamic and math.isfinite(loss)
                skips_in_a_row = skips_in_a_row + 1 if result.skipped and not overflow else 0
                done = step + 1
                spike = spikes.is_spike(done, loss, after_warmup=step >= self.schedule.kw["warmup"])
                if spikes.enabled and env.pp_size > 1:  # only the last stage sees the loss: all ranks follow it
                    spike = not env.all_ok(not spike)
                if spike:
                    step = self._roll_back(done, loss, spikes, log)
                    continue
                rec = {
                    "step": done,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / dt,
                    "samples_per_s": plan.global_batch / dt,
                    "mfu": fpt * tokens_per_step / dt / (peak * env.world_size),
                    "step_time_s": dt,
                    **clock.breakdown(dt),
                    **self.observers.comm_time(),
                    **memory.record(),
                    "skipped_steps": self.skipped_steps,
                    "rollbacks": self.rollbacks,
                    **({"loss_scale": scale_used} if self.scaler.dynamic or scale_used != 1.0 else {}),
                }
                new_best = False  # this step's evaluation is the best so far (early stopping keeps its checkpoint)
                if self.eval_ds is not None and self._eval_due(done):
                    rec["eval_loss"] = self.evaluate()
                    new_best = self.early.update(rec["eval_loss"]) and self.early.enabled
                if result.skipped and overflow:
                    self.console.log(
                        f"step {done}: gradients overflowed at loss scale {scale_used:g}: step skipped, scale now "
                        f"{self.scaler.scale:g}"
                    )
                elif result.skipped:
                    self.console.log(
                        f"step {done}: loss {loss} / grad norm {grad_norm} is not finite: optimizer step skipped "
                        f"({skips_in_a_row} in a row, the run stops at {cfg.runner_wrapper.max_consecutive_skips})"
                    )
                log.write(rec)
                self.observers.write(rec)
                memory.write_report(self.out, rec)  # every rank's breakdown, after each measured step
                if skips_in_a_row >= cfg.runner_wrapper.max_consecutive_skips:
                    self.console.stop()
                    self.saver.wait()  # a save still being written is a good one: let it complete
                    good = [c for c in store.list_checkpoints(self.out) if store.saved_finite(c)]
                    raise RunFailed(
                        f"{skips_in_a_row} steps in a row (to step {done}) had a non-finite loss or gradient norm: "
                        f"the run stopped. Newest checkpoint saved with a finite loss: "
                        f"{good[-1].name if good else 'none'}. Lower learning_rate, check the data near step {done}, "
                        f"then resume (load_checkpoint: that checkpoint)"
                    )
                first, last = first or rec, rec
                self.console.step(done, rec, print_now=(done % print_every == 0 or done == self.total_steps))
                env.at_step(done)
                self.saver.poll()  # completes a background save once every rank has written it
                every = ckpt_cb is not None and done % ckpt_cb.save_checkpoint_steps == 0
                if (every or new_best) and done < self.total_steps:
                    self.save(done, best=new_best)
                if self.early.should_stop:
                    end = done
                    self.console.log(
                        f"early stopping after step {done}: no better validation loss in {self.early.patience} "
                        f"evaluations (best {self.early.best:.4f}, kept in the checkpoint marked best)"
                    )
                    break
                if stop.agreed(env):  # a rank was signalled (preemption): everyone saves and returns
                    end = done
                    self.console.log(f"{stop.received}: stopping after step {done}; resume with resume_training")
                    break
                step = done
            self.console.stop()
            self.observers.close()
            if first is not None:
                self.console.log(
                    f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
                    f"(step {last['step']}); metrics in {self.out / 'metrics.jsonl'}"
                )
            if self._saved_at != end and (end > self.start_step or not store.list_checkpoints(self.out)):
                self.save(end, best=end > self.start_step and new_best)
            self.saver.wait()
        if env.is_metrics_rank:
            where = self.observers.finish(cfg, env.dims, plan.global_batch)
            if where is not None:
                self.console.log(f"journal: {where} (meshformer journal {where.parent})")
        return last

    def _roll_back(self, spike_step: int, loss: float, spikes: SpikeDetector, log) -> int:
        """Reload the newest good checkpoint of this run and skip the batches since it; returns its step."""
        self.rollbacks += 1
        # Only the last pipeline stage has the losses; other ranks follow its decision and log nothing.
        mean = spikes.mean() if spikes.history else 0.0
        ratio = loss / mean if mean else float("nan")
        if self.rollbacks > MAX_ROLLBACKS:
            raise RunFailed(
                f"step {spike_step}: loss {loss:.4g} is another spike ({ratio:.1f}x the recent mean) after "
                f"{MAX_ROLLBACKS} rollbacks: the run stopped; lower learning_rate or raise loss_spike_factor"
            )
        self.saver.wait()  # the newest checkpoint may still be being written
        ckpt = on_rank0(self.env, lambda: str(store.newest_good(self.out)[0] or ""))
        if not ckpt:
            raise RunFailed(
                f"step {spike_step}: loss {loss:.4g} is {ratio:.1f}x the recent mean {mean:.4g} but "
                f"{self.out} has no checkpoint to roll back to: save more often (save_checkpoint_steps)"
            )
        ckpt = Path(ckpt)
        state = store.read_trainer_state(ckpt)
        back = int(state["step"])
        store.load_model_weights(ckpt, self.parts.parts, self.expected_shapes)
        store.load_optimizer(ckpt, self.parts.parts, self.optimizer.items)
        self.scaler.load(state)
        # Step `back` on must read the batch after the spike's. Counted from this run's current offset, not the
        # checkpoint's, so a second rollback to the same checkpoint also skips what the first replay read.
        skipped = spike_step + self.data_offset - back - int(state.get("data_offset", 0))
        self.data_offset += spike_step - back
        self.skipped_steps = int(state.get("skipped_steps", 0))
        spikes.forget_after(back)
        log.truncate(back)
        self.observers.roll_back(back)
        self.console.log(
            f"step {spike_step}: loss {loss:.4g} is {ratio:.1f}x the mean {mean:.4g} of the last "
            f"{len(spikes.history)} steps: rolled back to {ckpt.name} and skipped its {skipped} batch(es) after "
            f"it (rollback {self.rollbacks} of at most {MAX_ROLLBACKS})"
        )
        return back

    def _inputs_labels(self, ds, order: GlobalBatches, b: int) -> tuple[Tensor, Tensor, Tensor | None]:
        field = f"{'train' if ds is self.train_ds else 'eval'}_dataset"
        return order.model_inputs(ds, b, self.env.device, self.mc.vocab_size, self.mc.ignore_token_id, field)

    def _eval_due(self, done: int) -> bool:
        every = self.cfg.eval_config.eval_interval
        return (every > 0 and done % every == 0) or (self.cfg.do_eval and done == self.total_steps)

    def evaluate(self) -> float:
        """Mean token loss over eval_iters validation batches (fixed order, so comparable across steps)."""
        order, ds = self.eval_batches, self.eval_ds

        def batches():
            for b in range(min(self.cfg.eval_config.eval_iters, order.per_epoch)):
                yield self._inputs_labels(ds, order, b)

        return evaluate(self.parts, self.env, batches(), self.eval_micro_batch, self.mc.ignore_token_id)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def _make_saver(self) -> CheckpointSaver:
        ckpt_cb = next((c for c in self.cfg.callbacks if c.type == "CheckpointMonitor"), None)
        keep = ckpt_cb.keep_checkpoint_max if ckpt_cb else 5
        async_save = bool(ckpt_cb and ckpt_cb.async_save)
        return CheckpointSaver(
            self.env.rank,
            self.env.all_ok,
            self.env.barrier,
            async_save,
            self.env.side_groups(2) if async_save else (None, None),
            on_saved=lambda path: self._saved(path, keep),
        )

    def save(self, step: int, best: bool = False) -> None:
        """Save at `step` (complete on return, or pending in the background with async_save)."""
        env = self.env
        self._saved_at = step
        path = store.checkpoint_root(self.out) / f"step_{step:08d}"
        state = {
            "step": step,
            "global_batch": self.plan.global_batch,
            "seed": self.cfg.seed,
            "seq_length": self.mc.seq_length,
            "tokenizer_hash": self.tokenizer_hash,
            "layout": {"data_parallel": env.dp_size, "model_parallel": env.tp_size, "pipeline_stage": env.pp_size},
            "skipped_steps": self.skipped_steps,
            "data_offset": self.data_offset,
            "rollbacks": self.rollbacks,
            "finite": self.last_finite,  # pruning never drops the newest finite checkpoint for non-finite ones
            "best": best,  # early stopping: pruning keeps the newest checkpoint marked best
            **self.early.state(),
            **self.scaler.state(),
            **({BASE_KEY: self.hf_base} if self.hf_base else {}),
        }
        files = {
            "config.yaml": yaml.safe_dump(to_dict(self.cfg), sort_keys=False).encode(),
            "tokenizer.json": self.tokenizer_bytes,
            **self.tokenizer_side_files,
        }
        self.saver.save(path, self.parts.parts, self.optimizer.items, state, files)

    def _saved(self, path: Path, keep: int) -> None:
        """A checkpoint is complete: say so, drop the replaced run, prune older checkpoints."""
        self.console.log(f"saved checkpoint {path}")
        self.run_dir.saved()
        if self.env.rank == 0:
            for gone in store.prune_checkpoints(self.out, keep):
                self.console.log(f"removed old checkpoint {gone.name} (keep_checkpoint_max={keep})")


def run_training(cfg: MeshformerConfig, notices: list[str] | None = None) -> dict:
    """Train; a collective that fails because a rank died or hung ends the run naming that rank (RunFailed)."""
    notices = [*(notices or []), *apply_finetune_base(cfg)]
    env = init_parallel(cfg)
    if cfg.swap_config.swap and env.device.type != "cuda":
        notices.append("swap_config.swap: a CPU run keeps activations in host memory anyway; swap is off")
    trainer, ok = None, False
    try:
        trainer = Trainer(cfg, notices, env)
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
            trainer.saver.close()
            trainer.run_dir.unlock()
        env.shutdown(clean=ok)
