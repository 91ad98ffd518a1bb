"""`meshformer generate`: continue a prompt with a trained checkpoint.

The checkpoint (a run's output_dir, whose newest checkpoint is used, or one checkpoint directory) is loaded by
`meshformer.checkpoint.load_for_inference`, which returns the model, its config and its tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from meshformer.errors import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="Generate text from a checkpoint.",
        description="Continue --prompt (several: repeat it, or --prompts-file) with a trained model and print "
        "prompt + completion; several prompts run as one left-padded batch.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a run's output_dir (its newest checkpoint is used) or one checkpoint directory",
    )
    p.add_argument(
        "--prompt", action="append", default=[], help="text to continue (with --chat: the user's message); repeatable"
    )
    p.add_argument(
        "--prompts-file", default=None, metavar="FILE", help="one more prompt per line (blank lines skipped)"
    )
    p.add_argument(
        "--json", action="store_true", help='print one JSON object per prompt: {"prompt", "completion", "tokens"}'
    )
    p.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to --prompt and print only the reply"
    )
    p.add_argument("--system", default=None, help="with --chat: a system message before the user's")
    p.add_argument(
        "--template",
        default=None,
        metavar="NAME|FILE",
        help="with --chat: chatml, llama3, llama2 or a .jinja file (default: the checkpoint's own template)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate at most (default 64)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="softmax temperature; 0 means greedy (default 1.0)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="nucleus sampling: sample from the smallest set of tokens with mass >= P (default 1.0: off)",
    )
    p.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample from the K most likely tokens (default 0: off)"
    )
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (ignores sampling flags)")
    p.add_argument(
        "--seed", type=int, default=None, metavar="S", help="seed for reproducible sampling (default: random)"
    )
    p.add_argument("--device", default=None, help="where to run, e.g. cpu or cuda:0 (default: cuda when available)")
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    if args.prompts_file is not None:
        f = Path(args.prompts_file)
        if not f.is_file():
            raise UserError(f"--prompts-file {args.prompts_file!r} is not a file: give a text file, a prompt a line")
        args.prompt = [*args.prompt, *(ln for ln in f.read_text(encoding="utf-8").splitlines() if ln.strip())]
    if not args.prompt:
        raise UserError("--prompt: give the text to continue (repeat --prompt, or --prompts-file, for several)")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: must be >= 0 (0 means greedy)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1]; 1 turns nucleus sampling off")
    if args.top_k < 0:
        raise UserError(f"--top-k {args.top_k}: must be >= 0; 0 turns top-k off")
    if args.seed is not None and args.seed < 0:
        raise UserError(f"--seed {args.seed}: must be >= 0")
    if not Path(args.checkpoint).exists():
        raise UserError(
            f"--checkpoint {args.checkpoint!r} does not exist: pass a run's output_dir or a checkpoint directory"
        )


def special_ids(tokenizer, mc) -> tuple[int | None, int | None]:
    """(bos, eos): the model config's ids when set, else the tokenizer's own special tokens (or None)."""
    from meshformer.data.tokenizer import special_token_ids

    try:
        found = special_token_ids(tokenizer)
    except UserError:  # a tokenizer without an end-of-text token: generate to max-new-tokens
        found = {"bos": None, "eos": None}
    bos = mc.bos_token_id if mc.bos_token_id is not None else found["bos"]
    eos = mc.eos_token_id if mc.eos_token_id is not None else found["eos"]
    return bos, eos


def chat_prompt(args, tokenizer, prompt: str) -> tuple[str, set[int]]:
    """(the rendered conversation up to the assistant's turn, the token ids that end a reply)."""
    from meshformer.checkpoint.store import resolve_checkpoint
    from meshformer.data.chat import load_chat_template, render_chat, template_tokens

    ckpt = resolve_checkpoint(args.checkpoint)
    tok_cfg_file = ckpt / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_file.read_text(encoding="utf-8")) if tok_cfg_file.is_file() else {}
    template = load_chat_template(ckpt, args.template)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}
    ]
    specials = template_tokens(tok_cfg)
    text = render_chat(template, messages, add_generation_prompt=True, **specials)
    ends = (specials["eos_token"], "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>")
    return text, {i for t in ends if t and (i := tokenizer.token_to_id(t)) is not None}


def encode_prompt(tokenizer, prompt: str, mc, bos: int | None, add_special_tokens: bool = True) -> list[int]:
    ids = list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)
    if not ids and bos is not None:  # an empty prompt starts from BOS
        ids = [bos]
    if not ids:
        raise UserError("--prompt encodes to no tokens: give some text to continue")
    bad = [t for t in ids if t >= mc.vocab_size]
    if bad:
        raise UserError(
            f"--prompt: token id {bad[0]} is outside the model's vocab_size={mc.vocab_size}: "
            f"the checkpoint's tokenizer does not match its model"
        )
    return ids


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at module level: every `meshformer` command imports this module

    check_args(args)
    from meshformer import checkpoint  # looked up at call time so tests can substitute the loader
    from meshformer.models.generate import generate_batch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, cfg, tokenizer = checkpoint.load_for_inference(args.checkpoint, device=device)
    mc = cfg.model.model_config
    bos, eos = special_ids(tokenizer, mc)
    stop: set[int] = {eos} if eos is not None else set()
    prompts = []
    for prompt in args.prompt:
        if args.chat:
            text, chat_stop = chat_prompt(args, tokenizer, prompt)
            prompts.append(encode_prompt(tokenizer, text, mc, bos, add_special_tokens=False))
            stop |= chat_stop
        else:
            prompts.append(encode_prompt(tokenizer, prompt, mc, bos))
    gen = None
    if not args.greedy:
        gen = torch.Generator(device=next(model.parameters()).device)
        if args.seed is None:
            gen.seed()
        else:
            gen.manual_seed(args.seed)
    t0 = time.perf_counter()
    news = generate_batch(
        model,
        prompts,
        args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        greedy=args.greedy,
        eos_id=stop,
        generator=gen,
    )
    dt = time.perf_counter() - t0
    texts = [_completion(args, tokenizer, p, ids, new, stop) for p, ids, new in zip(args.prompt, prompts, news)]
    for k, (prompt, text, new) in enumerate(zip(args.prompt, texts, news)):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": len(new)}, ensure_ascii=False))
        else:
            print(("\n" if k else "") + (text if args.chat else prompt + text))
    n = sum(len(new) for new in news)
    print(f"generated {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


def _completion(args, tokenizer, prompt: str, ids: list[int], new: list[int], stop: set[int]) -> str:
    """What follows the prompt: with --chat only the reply, without the token that ended it."""
    if args.chat:
        return tokenizer.decode(new[:-1] if new and new[-1] in stop else new, skip_special_tokens=True).strip()
    # Decode prompt and completion together (tokenizers merge spaces across the boundary), then keep what follows
    # the prompt's own decoding, so the user's prompt text is printed verbatim.
    full = tokenizer.decode(ids + new)
    prefix = tokenizer.decode(ids)
    return full[len(prefix) :] if full.startswith(prefix) else tokenizer.decode(new)
