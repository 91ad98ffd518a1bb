"""The trainer's checkpoint component: save, restore, loss-spike rollback, the saver and pruning.

A checkpoint's trainer_state.json is the trainer's state_dict: every component's `state_dict()` merged (this one
adds `data_offset` and `rollbacks`). The step is "global batches consumed", which names the same samples only if
the batch size, the seed and the sequence length agree (`run_identity`, checked by `check_resumable`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshformer.checkpoint import store
from meshformer.checkpoint.saver import CheckpointSaver
from meshformer.config.schema import MeshformerConfig
from meshformer.errors import RunFailed, UserError
from meshformer.parallel import ParallelEnv
from meshformer.train.run_dir import RunDir, on_rank0, set_aside_line
from meshformer.train.spikes import MAX_ROLLBACKS, SpikeDetector


def run_identity(cfg: MeshformerConfig, global_batch: int, tokenizer_hash: str | None) -> dict:
    """What makes a checkpoint's step mean the same samples (and tokens) in this run."""
    return {
        "global_batch": global_batch,
        "seed": cfg.seed,
        "seq_length": cfg.model.model_config.seq_length,
        "tokenizer_hash": tokenizer_hash,
    }


def check_resumable(ckpt: Path, state: dict, identity: dict) -> None:
    """The data position is "global batches consumed": it means the same samples only if these agree (the
    tokenizer is checked on its own, train/loading.py check_tokenizer)."""
    for key in ("global_batch", "seed", "seq_length"):
        now = identity[key]
        if state.get(key, now) != now:
            raise UserError(
                f"resume_training: {ckpt} was saved with {key}={state[key]} but this config gives "
                f"{now}: keep {key} to resume, or start a new run from its weights with "
                f"load_checkpoint (resume_training: false)"
            )


class Checkpointing:
    """This run's checkpoints: writing them (in line or async), pruning, loading one back, rolling back to one."""

    def __init__(self, cfg: MeshformerConfig, env: ParallelEnv, out: Path, run_dir: RunDir, log: Callable[[str], None]):
        self.env, self.out, self.run_dir, self.log = env, out, run_dir, log
        ckpt_cb = next((c for c in cfg.callbacks if c.type == "CheckpointMonitor"), None)
        self.every = ckpt_cb.save_checkpoint_steps if ckpt_cb is not None else None
        self.keep = ckpt_cb.keep_checkpoint_max if ckpt_cb else 5
        async_save = bool(ckpt_cb and ckpt_cb.async_save)
        self.saver = CheckpointSaver(
            env.rank,
            env.all_ok,
            env.barrier,
            async_save,
            env.side_groups(2) if async_save else (None, None),
            on_saved=self._saved,
        )
        self.saved_at = -1  # step of this run's newest checkpoint
        self.data_offset = 0  # global batches skipped by loss-spike rollbacks (step s reads batch s + offset)
        self.rollbacks = 0

    def state_dict(self) -> dict:
        return {"data_offset": self.data_offset, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.data_offset = int(state.get("data_offset", 0))
        self.rollbacks = int(state.get("rollbacks", 0))

    def due(self, step: int) -> bool:
        """CheckpointMonitor's save_checkpoint_steps falls on `step`."""
        return self.every is not None and step % self.every == 0

    def save(self, step: int, parts, optimizers, state: dict, files: dict[str, bytes]) -> None:
        """Save at `step` (complete on return, or pending in the background with async_save)."""
        self.saved_at = step
        path = store.checkpoint_root(self.out) / f"step_{step:08d}"
        self.saver.save(path, parts, optimizers, state, files)

    def _saved(self, path: Path) -> None:
        """A checkpoint is complete: say so, drop the replaced run, prune older checkpoints."""
        self.log(f"saved checkpoint {path}")
        self.run_dir.saved()
        if self.env.rank == 0:
            for gone in store.prune_checkpoints(self.out, self.keep):
                self.log(f"removed old checkpoint {gone.name} (keep_checkpoint_max={self.keep})")

    @staticmethod
    def load(ckpt: Path, parts, optimizers, expected_shapes: dict) -> None:
        """The model weights (strict: every tensor by name and global shape) and the optimizer states."""
        store.load_model_weights(ckpt, parts, expected_shapes)
        store.load_optimizer(ckpt, parts, optimizers)

    def roll_back(
        self, spike_step: int, loss: float, spikes: SpikeDetector, parts, optimizers, expected_shapes: dict
    ) -> tuple[int, dict]:
        """Reload the newest good checkpoint of this run and skip the batches since it; returns its step and its
        trainer state (the caller restores the other components from it)."""
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

        def newest_good():  # newer damaged ones are set aside: the replay's saves of their steps must not replace them
            good, skipped = store.newest_good(self.out)
            return str(good or ""), [set_aside_line(c, why) for c, why in skipped]

        ckpt, notes = on_rank0(self.env, newest_good)
        for note in notes:
            self.log(note)
        if not ckpt:
            raise RunFailed(
                f"step {spike_step}: loss {loss:.4g} is {ratio:.1f}x the recent mean {mean:.4g} but "
                f"{self.out} has no checkpoint to roll back to: save more often (save_checkpoint_steps)"
            )
        ckpt = Path(ckpt)
        state = store.read_trainer_state(ckpt)
        back = int(state["step"])
        self.load(ckpt, parts, optimizers, expected_shapes)
        # Step `back` on must read the batch after the spike's. Counted from this run's current offset, not the
        # checkpoint's, so a second rollback to the same checkpoint also skips what the first replay read.
        skipped = spike_step + self.data_offset - back - int(state.get("data_offset", 0))
        self.data_offset += spike_step - back
        spikes.forget_after(back)
        self.log(
            f"step {spike_step}: loss {loss:.4g} is {ratio:.1f}x the mean {mean:.4g} of the last "
            f"{len(spikes.history)} steps: rolled back to {ckpt.name} and skipped its {skipped} batch(es) after "
            f"it (rollback {self.rollbacks} of at most {MAX_ROLLBACKS})"
        )
        return back, state
