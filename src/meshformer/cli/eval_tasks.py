"""`meshformer eval --checkpoint DIR --tasks T1,T2`: lm-evaluation-harness tasks on a checkpoint.

The checkpoint loads into each process whole (interop/inference.py); lm-eval scores it through
train/lm_eval_model.py. Under torchrun every rank takes its share of each task's documents and rank 0 gathers,
prints the table and writes --output in lm-eval's own results format (results_<date>.json, and with
--log-samples each task's samples_<task>_<date>.jsonl).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from meshformer.errors import UserError


def add_arguments(p) -> None:
    g = p.add_argument_group("benchmarks (lm-evaluation-harness; pip install 'meshformer[eval]')")
    g.add_argument("--tasks", metavar="T1,T2", help="lm-eval tasks, groups or tags, comma separated")
    g.add_argument("--include-path", metavar="DIR", help="a folder of task YAMLs of your own, beside lm-eval's")
    g.add_argument("--num-fewshot", type=int, default=None, metavar="N", help="few-shot examples per prompt")
    g.add_argument("--limit", type=float, default=None, metavar="N", help="documents per task (or a fraction < 1)")
    g.add_argument("--batch-size", type=int, default=1, metavar="N", help="requests per forward pass")
    g.add_argument("--apply-chat-template", action="store_true", help="prompts through the checkpoint's chat template")
    g.add_argument("--output", metavar="PATH", help="write lm-eval's results JSON under this folder (or to this .json)")
    g.add_argument("--log-samples", action="store_true", help="with --output: every document's requests and answers")
    g.add_argument("--device", default=None, help="where to run, e.g. cpu or cuda:0 (default: cuda when available)")
    g.add_argument(
        "--seed", type=int, default=None, help="few-shot sampling and sampled generation (default: lm-eval's seeds)"
    )


def check_arguments(args) -> list[str]:
    """The task names; every flag checked before anything loads."""
    from meshformer.train.benchmarks import check_limit, require_lm_eval

    if args.input is not None:
        raise UserError("give --input FILE (loss and perplexity) or --tasks T1,T2 (benchmarks), not both")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot {args.num_fewshot}: give 0 or more examples")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: give at least 1")
    if args.log_samples and not args.output:
        raise UserError("--log-samples writes beside the results: give --output PATH too")
    check_limit(args.limit, "--limit")
    require_lm_eval("--tasks")
    return [t.strip() for t in args.tasks.split(",") if t.strip()]


def _distributed(device) -> bool:
    """Join torchrun's process group when launched under it (WORLD_SIZE > 1)."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl's object gathers use the current device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True


def run_tasks_cmd(args) -> int:
    import torch

    from meshformer.cli.devices import device_from_flag
    from meshformer.dtypes import DTYPE
    from meshformer.interop.inference import load_for_inference
    from meshformer.train.benchmarks import check_generation_room, check_tasks, run_tasks, task_manager
    from meshformer.train.lm_eval_model import MeshformerLM, hf_tokenizer

    names = check_arguments(args)
    manager = task_manager(args.include_path)
    check_tasks(manager, names, "--tasks")
    device = device_from_flag(args.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    distributed = _distributed(device)
    model, cfg, _ = load_for_inference(args.checkpoint, device=str(device))
    mc = cfg.model.model_config
    check_generation_room(manager, names, mc.max_position_embedding or mc.seq_length, "--tasks")
    ckpt = _checkpoint_dir(args.checkpoint)
    lm = MeshformerLM(
        model,
        hf_tokenizer(ckpt),
        max_length=mc.max_position_embedding or mc.seq_length,
        batch_size=args.batch_size,
        autocast_dtype=DTYPE[mc.compute_dtype] if mc.compute_dtype != mc.param_init_type else None,
        group=torch.distributed.group.WORLD if distributed else None,
    )
    tracker = _tracker(args.output) if args.output else None
    results = run_tasks(
        lm,
        manager,
        names,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        apply_chat_template=args.apply_chat_template,
        log_samples=args.log_samples,
        tracker=tracker,
        seed=args.seed,
    )
    if results is not None:  # rank 0
        _report(results, tracker, args.log_samples, ckpt)
    if distributed:
        torch.distributed.destroy_process_group()
    return 0


def _checkpoint_dir(path: str) -> Path:
    from meshformer.checkpoint.store import resolve_checkpoint

    return resolve_checkpoint(path, [])


def _tracker(output: str):
    from lm_eval.loggers import EvaluationTracker

    return EvaluationTracker(output_path=output)


def _report(results: dict, tracker, log_samples: bool, ckpt: Path) -> None:
    from lm_eval.utils import make_table

    samples = results.pop("samples", None)
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if tracker is None:
        return
    # The run's name in the results (lm-eval's is random for a model it did not load): the checkpoint's.
    tracker.general_config_tracker.model_name = str(ckpt)
    tracker.general_config_tracker.model_name_sanitized = "meshformer__" + ckpt.name
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"] if log_samples and samples else ():
        tracker.save_results_samples(task_name=task, samples=samples[task])
    print(f"results written under {tracker.output_path}", file=sys.stderr)
