"""lm-evaluation-harness tasks on meshformer's model: the task registry, input checks, the run, the metrics.

Shared by `meshformer eval --tasks` (a checkpoint) and the trainer (eval_config.tasks, on the training model).
Tasks come from lm-eval's registry or from task YAMLs under an include path (local data files: no hub). Every
check here is one line naming the option and the fix: lm-eval not installed, an unknown task (with the closest
names lm-eval knows), a task file that does not parse, a limit of 0.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import random
from pathlib import Path

from meshformer.errors import UserError

EXTRA = "pip install 'meshformer[eval]'"


def require_lm_eval(field: str) -> None:
    """One line naming the extra to install when lm-eval is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"{field} runs lm-evaluation-harness, which is not installed: {EXTRA}") from None


def check_limit(limit: float | None, field: str) -> None:
    """lm-eval's limit: a count of documents (>= 1) or a fraction of them (0 < limit < 1)."""
    if limit is not None and limit <= 0:
        raise UserError(
            f"{field} {limit:g}: give a number of documents per task (>= 1) or a fraction (0 < limit < 1), "
            "or leave it out for all of them"
        )


def _check_task_files(include: Path, field: str) -> None:
    """Parse every task YAML under `include` as lm-eval will (its index skips a bad file without a word)."""
    # lm-eval's own YAML reader (its `!function` tags, `include:`); no public name in the pinned 0.4.13
    from lm_eval.tasks._yaml_loader import load_yaml

    if not include.exists():
        raise UserError(f"{field} {include}: no such file or directory")
    if not include.is_dir():  # lm-eval indexes the YAMLs of folders only
        raise UserError(f"{field} {include}: give the folder that holds the task YAML, not the file")
    files = sorted([*include.rglob("*.yaml"), *include.rglob("*.yml")])
    for f in files:
        try:
            cfg = load_yaml(str(f), resolve_func=False)
        except Exception as e:  # yaml's errors, an !include that is missing, ...
            why = " ".join(str(e).split())
            raise UserError(f"{field}: task file {f} does not parse: {why}") from None
        if not isinstance(cfg, dict) or not (cfg.get("task") or cfg.get("group") or cfg.get("tag")):
            raise UserError(f"{field}: task file {f} names no task (a `task:` key), nor a group or tag")


# A TaskManager parses every task YAML lm-eval ships (thousands) when it is made, and reads them only to build its
# index (each task it builds copies its config). One process that evaluates again (a test session, `eval` called
# twice) reuses the last few it made, by include folder and that folder's files as they are now.
_MANAGERS: dict[tuple, object] = {}
_MANAGERS_KEPT = 2  # each holds the whole index in memory


def _folder_stamp(folder: Path) -> tuple:
    """Every file under folder with its size and modification time: a changed task file makes a new manager."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def task_manager(include_path: str | None, field: str = "--include-path"):
    """lm-eval's TaskManager over its registry plus the task YAMLs under include_path (checked first)."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    key: tuple = ()
    if include_path:
        _check_task_files(Path(include_path), field)
        key = (str(Path(include_path).resolve()), _folder_stamp(Path(include_path)))
    if key not in _MANAGERS:
        while len(_MANAGERS) >= _MANAGERS_KEPT:
            _MANAGERS.pop(next(iter(_MANAGERS)))
        _MANAGERS[key] = TaskManager(include_path=str(include_path)) if include_path else TaskManager()
    return _MANAGERS[key]


def check_tasks(manager, names: list[str], field: str) -> None:
    """Every name is a task, group or tag lm-eval knows; else one line with the closest it does."""
    if not names:
        raise UserError(f"{field}: name at least one lm-eval task (comma separated)")
    known = set(manager.all_tasks)
    for name in names:
        if name in known or manager.match_tasks([name]):
            continue
        close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
        hint = f" (closest: {', '.join(close)})" if close else ""
        raise UserError(
            f"{field}: {name!r} is not an lm-eval task{hint}: `lm-eval ls tasks` lists them; a task of your own is "
            "a YAML under --include-path DIR (eval_config.include_path)"
        )


def check_generation_room(manager, names: list[str], max_length: int, field: str) -> None:
    """A task whose YAML asks for max_gen_toks >= the model's positions leaves no room for a prompt: one line
    before lm-eval builds anything (and prints its notes on the task). A group's tasks, or a value a task takes
    from an included file, are checked when generation starts (train/lm_eval_model.py)."""
    for name in names:
        cfg = getattr(manager.task_index.get(name), "cfg", None) or {}
        new = (cfg.get("generation_kwargs") or {}).get("max_gen_toks")
        if isinstance(new, int) and new >= max_length:
            raise UserError(
                f"{field}: task {name!r} asks for generation_kwargs.max_gen_toks {new}, which leaves no room for a "
                f"prompt in the model's {max_length} positions: give the task a max_gen_toks below {max_length}"
            )


def run_tasks(
    lm,
    manager,
    tasks: list[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    apply_chat_template: bool = False,
    log_samples: bool = False,
    tracker=None,
    seed: int | None = None,
) -> dict | None:
    """lm-eval's simple_evaluate on `lm`; its results dict on rank 0, None on the other ranks. `seed` (few-shot
    sampling, sampled generation) replaces lm-eval's default seeds, so that its own runs compare without it."""
    import lm_eval

    seeds = {} if seed is None else {f"{k}random_seed": seed for k in ("", "numpy_", "torch_", "fewshot_")}
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=apply_chat_template,
        log_samples=log_samples,
        evaluation_tracker=tracker,
        **seeds,
    )


def flat_metrics(results: dict) -> dict[str, float]:
    """{"eval/<task>/<metric>": value} of every numeric metric (not its stderr); a filter other than lm-eval's
    "none" is kept in the name: "eval/<task>/<metric>_<filter>"."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            out[f"eval/{task}/{metric if filt == 'none' else f'{metric}_{filt}'}"] = float(value)
    return out


class TrainingBenchmarks:
    """eval_config.tasks on the training model at each evaluation, each task's metrics into the step's record.
    Everything a task run needs is checked when the trainer starts, before the first step.

    Under several processes (data parallel, FSDP, tensor parallel; config/validate.py refuses the layouts whose
    ranks do not each run the whole model) the data-parallel ranks split the documents and every rank runs as
    many forwards as the others (train/lm_eval_model.py); lm-eval hands its results to global rank 0 only, which
    sends the metrics to every rank, so all ranks leave the task pass together with the same record."""

    def __init__(self, cfg, tokenizer_bytes: bytes | None, side_files: dict[str, bytes]):
        import tempfile

        from meshformer.dtypes import DTYPE
        from meshformer.train.lm_eval_model import hf_tokenizer

        ec, mc = cfg.eval_config, cfg.model.model_config
        require_lm_eval("eval_config.tasks")
        check_limit(ec.limit, "eval_config.limit")
        self.manager = task_manager(ec.include_path or None, "eval_config.include_path")
        check_tasks(self.manager, list(ec.tasks), "eval_config.tasks")
        if tokenizer_bytes is None:
            raise UserError(
                "eval_config.tasks: this run has no tokenizer to write prompts with (its data carries none): set "
                "processor.tokenizer.tokenizer_file"
            )
        with tempfile.TemporaryDirectory() as tmp:  # transformers reads a tokenizer from files
            (Path(tmp) / "tokenizer.json").write_bytes(tokenizer_bytes)
            for name, data in side_files.items():
                (Path(tmp) / name).write_bytes(data)
            self.tokenizer = hf_tokenizer(tmp)
        self.cfg, self.max_length = cfg, mc.max_position_embedding or mc.seq_length
        check_generation_room(self.manager, list(ec.tasks), self.max_length, "eval_config.tasks")
        self.autocast = DTYPE[mc.compute_dtype] if mc.compute_dtype != mc.param_init_type else None

    def run(self, parts, env) -> dict[str, float]:
        """{"eval/<task>/<metric>": value} of the model as it is now, on every rank."""
        from meshformer.train.lm_eval_model import MeshformerLM

        ec = self.cfg.eval_config
        group = env.group("dp") if env.distributed and env.dp_size > 1 else None
        lm = MeshformerLM(parts.parts[0], self.tokenizer, self.max_length, ec.batch_size, self.autocast, group)
        parts.train(False)
        try:
            with _training_rng_kept():  # lm-eval seeds the global generators; training's draws must not change
                results = run_tasks(lm, self.manager, list(ec.tasks), num_fewshot=ec.num_fewshot, limit=ec.limit)
        finally:
            parts.train(True)
        metrics = flat_metrics(results) if results is not None else {}
        if env.distributed:
            import torch.distributed as dist

            sent = [metrics]
            dist.broadcast_object_list(sent, src=0)
            metrics = sent[0]
        return metrics


@contextlib.contextmanager
def _training_rng_kept():
    """Python's, NumPy's and torch's global generators as they were, once the block ends."""
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
    random.setstate(py)
    np.random.set_state(npy)
