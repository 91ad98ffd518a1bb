"""`meshformer launch --nproc N CONFIG [--section.field VALUE ...]`: torchrun on one node, layout checked first.

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


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="train on N processes of this machine (torchrun wrapper)",
        description="Start N training processes on this machine with torchrun. The layout "
        "(parallel_config) is checked against N before anything starts.",
    )
    p.add_argument("--nproc", type=int, required=True, help="processes (devices) on this node")
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="rendezvous port (default: torchrun --standalone picks a free one)",
    )
    p.add_argument("--print-command", action="store_true", help="print the torchrun command instead of running it")
    p.add_argument("config", help="YAML config file")
    p.set_defaults(func=run, accepts_overrides=True)


def torchrun_command(nproc: int, config: str, overrides: list[str], master_port: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{master_port}"]
    return cmd + ["-m", "meshformer", "train", config, *overrides]


def run(args) -> int:
    from meshformer.config.load import load_config
    from meshformer.config.validate import validate_run
    from meshformer.errors import UserError

    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: give the number of processes to start (at least 1)")
    cfg = load_config(args.config, args.overrides)
    validate_run(cfg, args.nproc)  # a wrong product fails here, before any process starts
    cmd = torchrun_command(args.nproc, args.config, args.overrides, args.master_port)
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    from meshformer.cli.launch_workers import supervise

    return supervise(cmd[3:], cfg.runner_config.preemption_grace_seconds)
