"""`meshformer eval --checkpoint DIR --input FILE [--json]`: mean token loss and perplexity of a text file;
`meshformer eval --checkpoint DIR --tasks T1,T2`: lm-evaluation-harness benchmarks (cli/eval_tasks.py).

The text is tokenized with the checkpoint's tokenizer and cut into windows of seq_length + 1 tokens (the last
one shorter); every token after the first of a window is predicted from the ones before it in that window.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from meshformer.cli.commands import add_command
from meshformer.cli.eval_tasks import add_arguments, run_tasks_cmd
from meshformer.errors import UserError


def add_parser(sub) -> None:
    p = add_command(
        sub, "eval", "loss and perplexity of a checkpoint on a text file, or lm-evaluation-harness benchmarks", __doc__
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint or a run's output_dir")
    p.add_argument("--input", metavar="FILE", help="a UTF-8 text file (loss and perplexity)")
    p.add_argument("--seq-length", type=int, default=None, metavar="N", help="window length (default: the model's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    from meshformer.interop.inference import load_for_inference

    if args.tasks is not None:
        return run_tasks_cmd(args)
    if args.input is None:
        raise UserError("give --input FILE (loss and perplexity) or --tasks T1,T2 (lm-evaluation-harness benchmarks)")
    if args.seq_length is not None and args.seq_length < 1:  # checked first: 0 must not mean "the model's"
        raise UserError(f"--seq-length {args.seq_length}: give a window of at least 1 token, or leave it out")
    src = Path(args.input)
    if not src.is_file():
        raise UserError(f"--input {src}: no such file")
    try:
        text = src.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--input {src}: not UTF-8 text") from None
    model, cfg, tok = load_for_inference(args.checkpoint)
    mc = cfg.model.model_config
    seq = args.seq_length if args.seq_length is not None else mc.seq_length
    positions = mc.max_position_embedding or mc.seq_length
    if args.seq_length is not None and seq > positions:  # rotary positions the model never saw
        raise UserError(
            f"--seq-length {seq}: the model's positions end at {positions} (model_config.max_position_embedding, "
            f"else seq_length): give --seq-length {positions} or less, or leave it out ({mc.seq_length})"
        )
    ids = tok.encode(text).ids
    if len(ids) < 2:
        raise UserError(f"--input {src}: fewer than two tokens of text: nothing to predict")
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, seq):
            window = torch.tensor([ids[start : start + seq + 1]])
            logits = model(window[:, :-1])
            total += F.cross_entropy(logits[0].float(), window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
    loss = total / count
    result = {"checkpoint": str(args.checkpoint), "input": str(src), "tokens": count, "loss": loss}
    result["perplexity"] = math.exp(loss)
    print(json.dumps(result) if args.json else f"{count} tokens: loss {loss:.4f}, perplexity {math.exp(loss):.3f}")
    return 0
