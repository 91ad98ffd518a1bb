"""Continue --prompt (several: repeat it, or --prompts-file) with a trained model and print prompt + completion as it is
generated; several prompts run as one left-padded batch. --chat replies instead: to --prompt, to a scripted conversation
(--messages FILE) or, on a terminal, interactively.

`meshformer generate`: continue a prompt with a trained checkpoint, or chat with it.

The checkpoint (a run's output_dir, whose newest checkpoint is used, or one checkpoint directory) is loaded by
`meshformer.interop.load_for_inference`, which returns the model, its config and its tokenizer. One prompt
(and every conversation, `cli/generate_chat.py`) prints its text as the tokens come; several prompts run as one
left-padded batch and print when it ends.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from meshformer.cli.commands import add_command
from meshformer.cli.devices import device_from_flag
from meshformer.errors import UserError


def add_parser(subparsers) -> None:
    p = add_command(subparsers, "generate", "Generate text from a checkpoint.", __doc__)
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
        "--chat",
        action="store_true",
        help="apply the model's chat template and print only the reply; with no --prompt or --messages, on a "
        "terminal: a conversation read from stdin (/exit or Ctrl-D ends)",
    )
    p.add_argument(
        "--messages",
        default=None,
        metavar="FILE",
        help="with --chat (implied): a conversation, a JSON list of {role, content} or JSONL; every user message "
        "not followed by an assistant's gets a reply, with the whole history before it",
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
    if args.messages is not None:
        args.chat = True
        if args.prompt:
            raise UserError("--messages and --prompt: give the conversation in one of them (add the turn to FILE)")
    if args.system is not None and not args.chat:
        raise UserError("--system: only with --chat (a plain prompt has no turns)")
    interactive = args.chat and not args.prompt and args.messages is None
    if interactive and not sys.stdin.isatty():
        raise UserError(
            "--chat: stdin is not a terminal: give --prompt TEXT or --messages FILE (a JSON list of {role, content})"
        )
    if interactive and args.json:
        raise UserError("--json: not with an interactive --chat (give the turns with --messages FILE)")
    if not args.prompt and not args.chat:
        raise UserError("--prompt: give the text to continue (repeat --prompt, or --prompts-file, for several)")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if not 0 <= args.temperature < float("inf"):  # nan: torch.multinomial's traceback; inf: uniform noise
        raise UserError(f"--temperature {args.temperature}: must be a number >= 0 (0 means greedy)")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1]; 1 turns nucleus sampling off")
    if args.top_k < 0:
        raise UserError(f"--top-k {args.top_k}: must be >= 0; 0 turns top-k off")
    if args.seed is not None and not 0 <= args.seed < 2**64:  # torch.Generator.manual_seed's range
        raise UserError(f"--seed {args.seed}: must be in [0, 2**64)")
    if not Path(args.checkpoint).exists():
        raise UserError(
            f"--checkpoint {args.checkpoint!r} does not exist: pass a run's output_dir or a checkpoint directory"
        )


def check_cache_fits(max_new_tokens: int, rows: int, model) -> None:
    """The KV cache is allocated for prompt + max_new_tokens at once: refuse a length whose cache alone would not
    fit in the device's free memory, before allocating it (a typo such as 10**9 would otherwise crash or swap)."""
    import torch

    from meshformer.models.registry import family_of

    mc, p = model.config, next(model.parameters())
    family = family_of(mc)
    width = family.kv_cache_width(mc)  # the family's cache (keys and values; latent attention its latent)
    per_slot = width * p.element_size() * rows
    per_token = mc.num_layers * per_slot
    if p.device.type == "cuda":
        free = torch.cuda.mem_get_info(p.device)[0]
    else:
        free = next(
            (
                int(ln.split()[1]) * 1024
                for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemAvailable:")
            ),
            None,
        )
    need = per_slot * family.kv_cache_tokens(mc, max_new_tokens)  # sliding-window layers keep their window only
    if free is not None and need > free:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: its KV cache alone would take {need / 2**30:.1f} GiB, more than "
            f"the {free / 2**30:.1f} GiB free on {p.device.type}: give at most {free // per_token:,}"
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
    device = device_from_flag(args.device)  # before loading: the devices here, not torch's error, if it is not one
    from meshformer import interop  # looked up at call time so tests can substitute the loader
    from meshformer.cli import generate_chat

    messages = generate_chat.read_messages(args.messages) if args.messages is not None else None
    model, cfg, tokenizer = interop.load_for_inference(args.checkpoint, device=str(device))
    mc = cfg.model.model_config
    check_cache_fits(args.max_new_tokens, max(len(args.prompt), 1), model)
    bos, eos = special_ids(tokenizer, mc)
    stop: set[int] = {eos} if eos is not None else set()
    spec = generate_chat.chat_spec(args.checkpoint, args.template, tokenizer) if args.chat else None
    if spec is not None:
        stop |= spec.stop
    gen = None
    if not args.greedy:
        gen = torch.Generator(device=next(model.parameters()).device)
        if args.seed is None:
            gen.seed()
        else:
            gen.manual_seed(args.seed)
    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        greedy=args.greedy,
        eos_id=stop,
        generator=gen,
    )
    t0 = time.perf_counter()
    if args.chat and (len(args.prompt) == 1 or not args.prompt):
        n = _converse(args, model, tokenizer, spec, mc, bos, sampling, messages)
    elif len(args.prompt) == 1 and not args.json:
        n = _stream_plain(args.prompt[0], model, tokenizer, mc, bos, sampling)
    else:
        n = _batch(args, model, tokenizer, spec, mc, bos, sampling)
    dt = time.perf_counter() - t0
    print(f"generated {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


def _converse(args, model, tokenizer, spec, mc, bos, sampling, messages) -> int:
    from meshformer.cli.generate_chat import Chat, with_system

    def encode(text: str) -> list[int]:
        return encode_prompt(tokenizer, text, mc, bos, add_special_tokens=False)

    chat = Chat(model, tokenizer, spec, encode, sampling, quiet=args.json)
    if messages is None and not args.prompt:
        print(f"chatting with {args.checkpoint}: type a message; /exit or Ctrl-D ends", file=sys.stderr)
        chat.interactive(args.system)
        return chat.tokens
    if messages is None:
        messages = [{"role": "user", "content": args.prompt[0]}]
    answered = chat.scripted(with_system(messages, args.system))
    if args.json:
        for prompt, reply, tokens in answered:
            print(json.dumps({"prompt": prompt, "completion": reply, "tokens": tokens}, ensure_ascii=False))
    return chat.tokens


def _stream_plain(prompt: str, model, tokenizer, mc, bos, sampling) -> int:
    from meshformer.cli.generate_chat import StreamText
    from meshformer.models import generate as gen

    ids = encode_prompt(tokenizer, prompt, mc, bos)
    stream = StreamText(tokenizer, prefix_ids=ids)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    n = 0
    for tok in gen.generate_stream(model, ids, **sampling):
        n += 1
        sys.stdout.write(stream.push(tok))
        sys.stdout.flush()
    print(stream.finish())
    return n


def _batch(args, model, tokenizer, spec, mc, bos, sampling) -> int:
    from meshformer.cli.generate_chat import with_system
    from meshformer.models.generate import generate_batch

    stop = sampling["eos_id"]
    prompts = []
    for prompt in args.prompt:
        if spec is not None:
            text = spec.render(with_system([{"role": "user", "content": prompt}], args.system))
            prompts.append(encode_prompt(tokenizer, text, mc, bos, add_special_tokens=False))
        else:
            prompts.append(encode_prompt(tokenizer, prompt, mc, bos))
    news = generate_batch(model, prompts, **sampling)
    texts = [_completion(args, tokenizer, p, ids, new, stop) for p, ids, new in zip(args.prompt, prompts, news)]
    for k, (prompt, text, new) in enumerate(zip(args.prompt, texts, news)):
        if args.json:
            print(json.dumps({"prompt": prompt, "completion": text, "tokens": len(new)}, ensure_ascii=False))
        else:
            print(("\n" if k else "") + (text if args.chat else prompt + text))
    return sum(len(new) for new in news)


def _completion(args, tokenizer, prompt: str, ids: list[int], new: list[int], stop: set[int]) -> str:
    """What follows the prompt: with --chat only the reply, without the token that ended it."""
    if args.chat:
        return tokenizer.decode(new[:-1] if new and new[-1] in stop else new, skip_special_tokens=True).strip()
    # Decode prompt and completion together (tokenizers merge spaces across the boundary), then keep what follows
    # the prompt's own decoding, so the user's prompt text is printed verbatim.
    full = tokenizer.decode(ids + new)
    prefix = tokenizer.decode(ids)
    return full[len(prefix) :] if full.startswith(prefix) else tokenizer.decode(new)
