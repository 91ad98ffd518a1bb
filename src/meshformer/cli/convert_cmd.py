"""`meshformer import` and `meshformer export`: published weights in, trained weights out.

meshformer import ./SmolLM2-135M-Instruct --output ckpt/smollm2 --verify    # a Hugging Face directory
meshformer import model.Q4_1.gguf --output ckpt/smollm2                     # or a GGUF file
meshformer import llama2_7b.ckpt --config pretrain_llama2_7b.yaml --output ckpt/llama2   # or MindSpore's
meshformer export runs/sft --output hf/sft --verify                          # a checkpoint or a run's output_dir
meshformer export runs/sft --format mindspore --output sft.ckpt [--fused]    # MindSpore Transformers' names
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from meshformer.errors import UserError
from meshformer.tolerance import TOLERANCE_TEXT


def add_parser(sub) -> None:
    i = sub.add_parser(
        "import",
        help="turn a Hugging Face model directory, a GGUF file or a MindSpore checkpoint into a meshformer checkpoint",
        description="Convert a Hugging Face model directory (config.json + safetensors or pytorch_model*.bin), "
        "a GGUF file, or a consolidated MindSpore checkpoint (.ckpt or .safetensors, MindSpore Transformers' names, "
        "with --config) into a meshformer checkpoint directory (weights, config.yaml, tokenizer).",
    )
    i.add_argument("source", help="a Hugging Face model directory, a .gguf file, or a MindSpore .ckpt/.safetensors")
    i.add_argument("--output", required=True, help="the checkpoint directory to create (must not exist)")
    i.add_argument(
        "--config",
        help="MindSpore checkpoints: the MindSpore Transformers YAML it was trained with (model.model_config gives "
        "the shape, processor.tokenizer.tokenizer_file or vocab_file the tokenizer.json)",
    )
    i.add_argument(
        "--verify", action="store_true", help=f"compare logits with transformers (exit 1 above {TOLERANCE_TEXT})"
    )
    i.set_defaults(func=run_import)
    e = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (or a GGUF file, or a MindSpore checkpoint)",
        description="Write a checkpoint (or a run's newest good one) as a directory that transformers loads: "
        "config.json, safetensors shards with an index, tokenizer files and chat template; with --format gguf one "
        "GGUF file, with --format mindspore one .ckpt that mindspore.load_checkpoint loads, in MindSpore "
        "Transformers' names.",
    )
    e.add_argument("checkpoint", help="a checkpoint/step_N directory or a run's output_dir")
    e.add_argument(
        "--output",
        required=True,
        help="the directory to create (must not exist); with --format gguf a .gguf file, with --format mindspore a "
        ".ckpt (or .safetensors) file",
    )
    e.add_argument(
        "--format",
        default="hf",
        choices=("hf", "gguf", "mindspore"),
        help="Hugging Face directory, one GGUF file, or one MindSpore checkpoint",
    )
    e.add_argument(
        "--fused",
        action="store_true",
        help="--format mindspore: each layer's q/k/v as one attention.w_qkv and gate/up as one "
        "feed_forward.w_gate_hidden (MindSpore Transformers' qkv_concat: True layout)",
    )
    e.add_argument(
        "--gguf-type", default="F16", choices=("F32", "F16", "BF16", "Q8_0"), help="GGUF tensor type (default F16)"
    )
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="weight dtype")
    e.add_argument("--shard-size", default="5GB", help="largest safetensors shard, e.g. 500MB or 5GB (default 5GB)")
    e.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA runs: write the full model with the adapters merged in (default: the adapter, PEFT's format)",
    )
    e.add_argument(
        "--base",
        help="LoRA adapters: the Hugging Face id or directory of the base model, written as the adapter's "
        "base_model_name_or_path (default: what the checkpoint recorded at import; needed when it recorded "
        "none or the base has moved)",
    )
    e.add_argument(
        "--verify",
        action="store_true",
        help=f"load the result in transformers and compare logits (exit 1 above {TOLERANCE_TEXT})",
    )
    e.set_defaults(func=run_export)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?\s*", text.upper())
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"--shard-size {text!r}: give a size like 500MB or 5GB")
    return int(float(m.group(1)) * 1024 ** "_KMGT".index(m.group(2) or "_"))


def run_import(args) -> int:
    from meshformer.interop.convert import import_model

    out, cfg = import_model(args.source, args.output, args.config)
    mc = cfg.model.model_config
    print(
        f"imported {args.source} -> {out}: {mc.type} {mc.num_layers} layers, hidden {mc.hidden_size}, "
        f"{mc.num_heads} heads ({mc.num_kv_heads} kv), vocab {mc.vocab_size}"
    )
    if args.verify:
        from meshformer.interop import parity
        from meshformer.interop.inference import load_for_inference

        src = Path(args.source)
        if src.suffix in (".ckpt", ".safetensors"):
            print("--verify compares with transformers, which cannot read a MindSpore checkpoint; not run")
            return 0
        model, _, tokenizer = load_for_inference(out)
        gguf = src.name if src.suffix == ".gguf" else None
        parity.verify(model, tokenizer, src.parent if gguf else src, gguf)
    return 0


def run_export(args) -> int:
    from meshformer.interop.convert import export_model

    if args.format == "mindspore":
        return _run_export_mindspore(args)
    if args.fused:
        print("--fused is for --format mindspore; not used")

    gguf_type = args.gguf_type if args.format == "gguf" else None
    out, ckpt, kind = export_model(
        args.checkpoint, args.output, args.dtype, parse_size(args.shard_size), args.merge_lora, gguf_type, args.base
    )
    what = {"adapter": "a PEFT LoRA adapter", "model": f"the model, {args.dtype}", "gguf": f"GGUF {gguf_type}"}
    print(f"exported {ckpt} -> {out} ({what[kind]})")
    if kind == "adapter":
        base = json.loads((out / "adapter_config.json").read_text()).get("base_model_name_or_path")
        print(
            f"base model: {base} (peft.AutoPeftModelForCausalLM.from_pretrained({str(out)!r}) loads it)"
            if base
            else "base model: unknown (the checkpoint records no Hugging Face base): AutoPeftModelForCausalLM "
            "needs it; PeftModel.from_pretrained(base_model, adapter_dir) works, or export again with --base"
        )
    elif args.base:
        print(f"--base is for LoRA adapters; not used for {what[kind]}")
    if args.verify and kind != "model":
        print(f"--verify compares Hugging Face directories with transformers; not run for {what[kind]}")
    elif args.verify:
        from meshformer.dtypes import DTYPE
        from meshformer.interop import parity
        from meshformer.interop.inference import load_for_inference

        model, _, tokenizer = load_for_inference(ckpt, need_tokenizer=False)  # none: random ids (parity.compare)
        model.to(DTYPE[args.dtype]).float()  # compare with the weights as exported (rounded to --dtype)
        parity.verify(model, tokenizer, out)
    return 0


def _run_export_mindspore(args) -> int:
    from meshformer.interop.convert import export_mindspore

    out, ckpt = export_mindspore(args.checkpoint, args.output, args.dtype, args.fused)
    layout = "fused w_qkv / w_gate_hidden" if args.fused else "separate wq/wk/wv, w1/w3"
    print(f"exported {ckpt} -> {out} (MindSpore checkpoint, {args.dtype}, {layout})")
    for flag, given in (("--verify", args.verify), ("--base", args.base), ("--merge-lora", args.merge_lora)):
        if given:
            print(f"{flag} is not used for --format mindspore (LoRA adapters are always merged in)")
    return 0
