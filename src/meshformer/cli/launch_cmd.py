"""Start N training processes on this machine with torchrun. The layout (parallel_config) is checked against N before
anything starts.

`meshformer launch --nproc N CONFIG [--section.field VALUE ...]`: torchrun on one node, layout checked first.

It checks that data_parallel x model_parallel x pipeline_stage equals N (one line, exit 2, no processes
started), then runs torchrun's agent (`torch.distributed.run --standalone --nproc-per-node N -m meshformer train
CONFIG ...`) in this process, so that it owns the workers (cli/launch_workers.py):

- SIGTERM, SIGINT and SIGUSR1 go to the workers, which save at the next step and exit 0; then so does launch.
  The agent itself is not told (it would stop the workers and report a failure); SIGHUP and SIGQUIT stay
  torchrun's (stop the workers).
- The workers die with it, even on SIGKILL (their death signal is tied to this process, train/preemption.py).
- Workers' errors reach the user once: each distinct `meshformer:` line is printed once, and the agent's own
  report is replaced by the exit code: 2 where a worker found a bad input, 1 otherwise, with one line naming the
  rank when no worker said why.

For several nodes call torchrun directly on each node (docs/parallelism.md).
"""

from __future__ import annotations

import shlex
import sys

from meshformer.cli.commands import add_command
from meshformer.errors import UserError

# Where the rendezvous listens when --master-port is given (one node: this machine's loopback).
MASTER_ADDR = "127.0.0.1"
# CPU processes a core that launch starts at most (tests run 4 ranks on 2 cores; thousands would swamp the machine).
PROCESSES_PER_CORE = 8
MULTI_NODE = "launch runs on this machine only: for several nodes run torchrun on each node (docs/parallelism.md)"


def add_parser(sub) -> None:
    p = add_command(sub, "launch", "train on N processes of this machine (torchrun wrapper)", __doc__)
    p.add_argument("--nproc", type=int, required=True, help="processes (devices) on this node")
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port (default: torchrun --standalone picks a free one)",
    )
    p.add_argument("--print-command", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("config", help="YAML config file")
    p.set_defaults(
        func=run,
        accepts_overrides=True,
        option_hints={flag: MULTI_NODE for flag in ("--nnodes", "--node-rank", "--node_rank", "--master-addr")},
    )


def torchrun_command(nproc: int, config: str, overrides: list[str], master_port: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{MASTER_ADDR}:{master_port}"]
    return cmd + ["-m", "meshformer", "train", config, *overrides]


def check_port_range(port: int) -> None:
    if not 1 <= port <= 65535:
        raise UserError(f"--master-port {port}: give a TCP port in 1..65535, or leave it out (torchrun picks one)")


def check_port_free(port: int) -> None:
    """Refuse a port held by another process: torchrun's agent would wait there as a client of that process for
    180 s or more. The test binds where the rendezvous store listens: every address (IPv6 and IPv4 where there is
    IPv6), with SO_REUSEADDR as the store, so a port only in TIME_WAIT counts as free."""
    import errno
    import socket

    for family, everywhere in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
            try:
                sock.bind((everywhere, port))
                return
            except OSError as e:
                why = "is taken by another process" if e.errno == errno.EADDRINUSE else f"cannot be used ({e.strerror})"
        raise UserError(
            f"--master-port {port}: the port {why}: give a free one, e.g. --master-port {free_port()}, or leave "
            f"it out (torchrun then picks one)"
        )


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick), for the hint above."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def check_nproc(nproc: int) -> None:
    """Refuse more processes than this machine can run, before any starts. With GPUs each process takes one
    (parallel/env.py local_device); on CPUs, more than PROCESSES_PER_CORE a core is a typo, not a layout test."""
    import os

    import torch

    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if nproc > gpus:
            raise UserError(
                f"--nproc {nproc}: this machine has {gpus} GPU(s), one per process: give at most {gpus} "
                f"(or fix CUDA_VISIBLE_DEVICES)"
            )
        return
    cores = len(os.sched_getaffinity(0))
    if nproc > PROCESSES_PER_CORE * cores:
        raise UserError(
            f"--nproc {nproc}: this machine has no GPU and {cores} CPU core(s): give at most "
            f"{PROCESSES_PER_CORE * cores} processes ({PROCESSES_PER_CORE} a core)"
        )


def run(args) -> int:
    from meshformer.config.load import load_config
    from meshformer.config.validate import validate_run
    from meshformer.interop.base_model import BASE_MODEL_SOURCES
    from meshformer.train.finetune import apply_finetune_base

    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: give the number of processes to start (at least 1)")
    if args.master_port is not None:
        check_port_range(args.master_port)
    cfg = load_config(args.config, args.overrides)
    apply_finetune_base(
        cfg, BASE_MODEL_SOURCES
    )  # a fine-tune's model is load_checkpoint's: its shape first, then the layout
    validate_run(cfg, args.nproc)  # a wrong product fails here, before any process starts
    cmd = torchrun_command(args.nproc, args.config, args.overrides, args.master_port)
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    check_nproc(args.nproc)
    if args.master_port is not None:
        check_port_free(args.master_port)  # checked last: a port is taken or not at the moment of starting
    from meshformer.cli.launch_workers import supervise

    return supervise(cmd[3:], cfg.runner_config.preemption_grace_seconds)
