"""Memory per pipeline stage (parameters, gradients, optimizer states, activations, logits, runtime, fragmentation) and
step time, tokens/s and MFU of a config's layout on an accelerator.

`meshformer plan CONFIG [--devices N] [--nodes K] [--accelerator NAME] [--device-memory GB] [--json]`: the
planner's figures (planner/), before anything runs."""

from __future__ import annotations

import json
import math

from meshformer.cli.commands import add_command
from meshformer.errors import UserError

GIB = 1 << 30


def add_parser(sub) -> None:
    p = add_command(sub, "plan", "predict memory per stage and throughput of a config before running it", __doc__)
    add_machine_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--explain", action="store_true", help="print every formula with its numbers substituted")
    p.add_argument(
        "--search",
        action="store_true",
        help="plan every valid layout for the devices and global batch; print those that fit, fastest first",
    )
    p.set_defaults(func=run, accepts_overrides=True)


def add_machine_arguments(p) -> None:
    """The config and the machine it is planned for (shared with `meshformer doctor`)."""
    p.add_argument("config", help="YAML config (dotted --section.field VALUE overrides may follow)")
    p.add_argument("--devices", type=int, default=None, help="device count (default: the layout's product)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the devices are spread over (default 1)")
    p.add_argument(
        "--accelerator",
        default="H100",
        metavar="NAME",
        help="H100, H200, A100, 910B or cpu (measured here); default H100",
    )
    p.add_argument("--device-memory", type=float, default=None, metavar="GB", help="override the device's memory")


def build(args):
    """(config, plan) of the command's arguments."""
    from meshformer.config.load import load_config
    from meshformer.interop.base_model import BASE_MODEL_SOURCES
    from meshformer.parallel.batch_plan import BatchPlan
    from meshformer.parallel.dims import ParallelDims
    from meshformer.planner.accelerators import find_accelerator
    from meshformer.planner.fits import check_plannable
    from meshformer.planner.plan import make_plan
    from meshformer.train.finetune import apply_finetune_base

    if args.devices is not None and args.devices < 1:  # checked first: 0 must not mean "the layout's product"
        raise UserError(f"--devices {args.devices}: give a device count of at least 1, or leave it out")
    if args.device_memory is not None and not (math.isfinite(args.device_memory) and args.device_memory > 0):
        raise UserError(f"--device-memory {args.device_memory}: give the device's memory in GB (a number > 0)")
    cfg = load_config(args.config, getattr(args, "overrides", []))
    apply_finetune_base(cfg, BASE_MODEL_SOURCES)  # a fine-tune plans load_checkpoint's model, not the schema's default
    pc = cfg.parallel_config
    devices = args.devices or pc.data_parallel * pc.model_parallel * pc.pipeline_stage * pc.context_parallel
    if args.nodes < 1 or devices % args.nodes:
        raise UserError(f"--nodes {args.nodes}: must be >= 1 and divide the {devices} devices")
    dims = ParallelDims.from_config(cfg, devices)
    batch = BatchPlan.from_config(cfg, dims)
    acc = find_accelerator(args.accelerator)
    mem = args.device_memory * 1e9 if args.device_memory else None
    check_plannable(cfg, dims, mem or acc.memory_bytes, acc.name)  # a size typo: refused before any layer is built
    return cfg, make_plan(cfg, dims, acc, batch.micro_batch, batch.n_micro, args.nodes, mem)


def run(args) -> int:
    _, plan = build(args)
    if args.search:
        return print_search(plan, args.json)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=1))
        return 0
    print_plan(plan)
    if args.explain:
        from meshformer.planner.explain import explain

        print("\n".join(explain(plan)))
    return 0


def print_plan(plan) -> None:
    from rich.console import Console
    from rich.table import Table

    d = plan.as_dict()
    lay = d["layout"]
    console = Console(width=max(Console().width, 132))
    console.print(
        f"[bold]{lay['devices']} x {plan.accelerator.name}[/bold] ({plan.device_memory / 1e9:.0f} GB each, "
        f"{lay['nodes']} node(s)): data_parallel {lay['data_parallel']} (optimizer shards {lay['optimizer_shard']}) "
        f"x model_parallel {lay['model_parallel']} x pipeline_stage {lay['pipeline_stage']}; micro batch "
        f"{lay['micro_batch']} x {lay['micro_batches_per_step']} per step, global batch {lay['global_batch']}",
        soft_wrap=True,
    )
    t = Table(title="memory per rank (GiB)")
    for col in (
        "stage",
        "layers",
        "params",
        "grads",
        "optimizer",
        "activations",
        "logits",
        "allocated",
        "reserved",
        "headroom",
    ):
        t.add_column(col, justify="right")
    for s in d["stages"]:
        g = lambda k: f"{s[k] / GIB:.2f}"  # noqa: E731
        t.add_row(
            str(s["stage"]),
            str(s["layers"]),
            g("params_bytes"),
            g("grads_bytes"),
            g("optimizer_bytes"),
            f"{s['activations_bytes'] / GIB:.2f} ({s['in_flight']} mb{', counted' * s['activations_counted']})",
            g("logits_bytes"),
            g("allocated_bytes"),
            g("reserved_bytes"),
            ("" if s["headroom_bytes"] >= 0 else "[red]") + g("headroom_bytes"),
        )
    console.print(t)
    c = d["communication_bytes_per_step"]
    ep = f", ep {c['ep'] / 1e9:.2f} GB" if c["ep"] else ""
    console.print(
        f"step: {d['flops_per_step'] / 1e15:.2f} PFLOP model ({d['flops_per_token'] / 1e9:.2f} GFLOP/token, "
        f"6N{'_active' if d['moe'] else ''} + 12·L·h·s, causal not halved); communication per rank: tp "
        f"{c['tp'] / 1e9:.2f} GB, dp "
        f"{c['dp'] / 1e9:.2f} GB, pp {c['pp'] / 1e9:.2f} GB{ep}; bubble {d['bubble_fraction']:.1%}",
        soft_wrap=True,
    )
    if d["moe"] is not None:
        m = d["moe"]
        console.print(
            f"MoE: {m['total_params'] / 1e9:.2f}B parameters, {m['active_params'] / 1e9:.2f}B active per token (the "
            f"FLOPs above); {m['routed_params'] / 1e9:.2f}B in routed experts, {m['experts_per_rank']} experts of "
            f"each of {m['moe_layers']} MoE layers per rank (expert_parallel {lay['expert_parallel']}, expert FSDP "
            f"{lay['expert_fsdp']}): {m['routed_params_per_rank'] / 1e9:.2f}B routed parameters per rank; "
            f"all-to-all {c['ep'] / 1e9:.2f} GB per rank and step, buffers {m['a2a_buffer_bytes'] / GIB:.2f} GiB",
            soft_wrap=True,
        )
    _print_second_model(console, plan, d)
    verdict = "[green]fits[/green]" if d["fits"] else "[red]does not fit[/red]"
    console.print(
        f"predicted: {d['step_time_s']:.3f} s/step, {d['tokens_per_s']:,.0f} tokens/s "
        f"({d['tokens_per_s'] / lay['devices']:,.0f} per device), {d['samples_per_s']:,.1f} samples/s, "
        f"MFU {d['mfu']:.1%} ({'compiled' if d['compiled'] else 'eager'}); {verdict}",
        soft_wrap=True,
    )


def _print_second_model(console, plan, d: dict) -> None:
    """A post-training run's reference or teacher (planner/second_model.py), and which reference would fit."""
    from meshformer.planner.doctor import reference_findings

    # the rank holding the last stage (a V schedule's first): the logits and the forward's peak are there
    second = max((s["second_model"] for s in d["stages"]), key=lambda m: (m["forward_bytes"], m["logits_bytes"]))
    weights = max(s["second_model"]["weights_bytes"] for s in d["stages"])
    parts = [f"frozen weights {weights / GIB:.2f} GiB per rank (in allocated)"] if weights else []
    if second["kind"] == "teacher":
        parts.append(
            f"its logits {second['logits_bytes'] / GIB:.2f} GiB kept for the loss, its no_grad forward "
            f"{second['forward_bytes'] / GIB:.2f} GiB at its peak: {second['beside_bytes'] / GIB:.2f} GiB beside the "
            "student's (in the logits column)"
        )
    elif second["forward_bytes"]:
        parts.append(f"its no_grad forward {second['forward_bytes'] / GIB:.2f} GiB at its peak, before the policy's")
    if second["kind"] == "reference: precomputed":
        disk = second["disk_bytes"]
        parts.append(f"{disk / GIB:.2f} GiB on disk" if disk is not None else "16 bytes a pair on disk")
    if second["kind"]:
        console.print(f"{second['kind']}: {', '.join(parts) or 'nothing on the device'}", soft_wrap=True)
    for line in reference_findings(plan):
        console.print(f"[yellow]{line}[/yellow]", soft_wrap=True)


def print_search(plan, as_json: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    from meshformer.planner.search import search

    best, planned = search(plan)
    rows = [
        {
            **c.layout,
            "tokens_per_s": c.plan.throughput.tokens_per_s,
            "mfu": c.plan.throughput.mfu,
            "bubble_fraction": c.plan.throughput.bubble_fraction,
            "reserved_bytes": max(s.reserved_bytes for s in c.plan.stages),
        }
        for c in best
    ]
    if as_json:
        print(json.dumps({"planned": planned, "fitting": rows}, indent=1))
        return 0
    console = Console(width=max(Console().width, 132))
    lay = plan.as_dict()["layout"]
    t = Table(
        title=f"layouts that fit {lay['devices']} x {plan.accelerator.name}, global batch {lay['global_batch']}: "
        f"the {len(rows)} fastest of {planned} planned"
    )
    for col in (
        "dp",
        "tp",
        "pp",
        "zero",
        "micro batch",
        "micro_batch_num",
        "accum",
        "recompute",
        "max GiB",
        "bubble",
        "tokens/s",
        "MFU",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["data_parallel"]),
            str(r["model_parallel"]),
            str(r["pipeline_stage"]),
            "yes" if r["optimizer_shard"] else "",
            str(r["micro_batch"]),
            str(r["micro_batch_num"]) if r["pipeline_stage"] > 1 else "",
            str(r["gradient_accumulation_steps"]),
            r["recompute"],
            f"{r['reserved_bytes'] / GIB:.1f}",
            f"{r['bubble_fraction']:.0%}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mfu']:.0%}",
        )
    console.print(t)
    if not rows:
        console.print("[red]no layout fits: fewer tokens per micro-batch (seq_length), LoRA, or more devices[/red]")
        return 1
    return 0
