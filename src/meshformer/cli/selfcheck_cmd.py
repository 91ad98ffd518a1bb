"""Run under torchrun on every rank: prints rank, world size, backend and mesh coordinates, then checks all_reduce,
all_gather and send/recv with a timeout.

`meshformer selfcheck [CONFIG]` under torchrun: is distributed communication working?

Prints each rank, the world size, the backend and (given a config) the rank's mesh coordinates, then checks
all_reduce, all_gather and a send/recv ring, each bounded by --timeout seconds, so a missing or dead rank is
reported (naming the peer for send/recv) instead of hanging. Exit code 0 when every check passes on this rank.

    torchrun --standalone --nproc-per-node 4 -m meshformer selfcheck
    torchrun --standalone --nproc-per-node 8 -m meshformer selfcheck config.yaml   # also shows (pp, dp, tp)
"""

from __future__ import annotations

import datetime
import os
import socket

from meshformer.cli.commands import add_command


def add_parser(sub) -> None:
    p = add_command(sub, "selfcheck", "check distributed communication (run under torchrun)", __doc__)
    p.add_argument("config", nargs="?", default=None, help="optional YAML config: also build its device mesh")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds each check may take (default 60)")
    p.set_defaults(func=run, accepts_overrides=True)


def _report(rank: int, name: str, ok: bool, detail: str) -> bool:
    print(f"[rank {rank}] {name}: {'ok' if ok else 'FAILED'} {detail}".rstrip(), flush=True)
    return ok


def run(args) -> int:
    import torch
    import torch.distributed as dist

    from meshformer.errors import UserError
    from meshformer.parallel.env import init_parallel, local_device, start_process_group

    if not 0 < args.timeout < float("inf"):  # nan or <= 0: timedelta's traceback, or checks that cannot pass
        raise UserError(f"--timeout {args.timeout}: give the seconds each check may take (a number > 0)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:
        print(
            "selfcheck: not started by torchrun (no RANK/WORLD_SIZE): world size 1, nothing to check.\n"
            "run e.g.: torchrun --standalone --nproc-per-node 2 -m meshformer selfcheck"
        )
        return 0
    timeout = datetime.timedelta(seconds=args.timeout)
    env = None
    if args.config is not None:
        from meshformer.config.load import load_config
        from meshformer.interop.base_model import BASE_MODEL_SOURCES
        from meshformer.train.finetune import apply_finetune_base

        cfg = load_config(args.config, args.overrides)
        apply_finetune_base(cfg, BASE_MODEL_SOURCES)  # a fine-tune's layout is checked against load_checkpoint's model
        cfg.comm_timeout = max(1, int(args.timeout))
        env = init_parallel(cfg)  # validates the layout against WORLD_SIZE first
    else:
        if args.overrides:
            raise UserError("selfcheck: overrides need a CONFIG argument")
        start_process_group(local_device(), args.timeout)  # the device and backend training would use
    rank = dist.get_rank()
    device = env.device if env is not None else local_device()
    coords = env.describe() if env is not None else f"rank {rank}/{world} backend={dist.get_backend()} device={device}"
    print(f"[rank {rank}] host={socket.gethostname()} local_rank={os.environ.get('LOCAL_RANK')} {coords}", flush=True)

    ok = True
    t = torch.tensor([float(rank + 1)], device=device)
    work = dist.all_reduce(t, async_op=True)
    want = world * (world + 1) / 2
    try:
        work.wait(timeout)
        ok &= _report(rank, "all_reduce", float(t) == want, f"sum={float(t):g} expected={want:g}")
    except Exception as e:  # a timeout or a dead peer: report it and go on to name peers in send/recv
        ok = _report(rank, "all_reduce", False, f"({type(e).__name__}: {str(e).splitlines()[0]})")

    out = [torch.zeros(1, device=device) for _ in range(world)]
    try:
        dist.all_gather(out, torch.tensor([float(rank)], device=device), async_op=True).wait(timeout)
        got = [int(x) for x in out]
        ok &= _report(rank, "all_gather", got == list(range(world)), f"ranks={got}")
    except Exception as e:
        ok = _report(rank, "all_gather", False, f"({type(e).__name__}: {str(e).splitlines()[0]})")

    # A ring: send to the next rank, receive from the previous one; a failure names the silent peer.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    buf = torch.zeros(1, device=device)
    try:
        if world == 1:  # nobody to talk to
            raise StopIteration
        sw = dist.isend(torch.tensor([float(rank)], device=device), nxt)
        rw = dist.irecv(buf, prv)
        rw.wait(timeout)
        sw.wait(timeout)
        ok &= _report(rank, "send/recv", int(buf) == prv, f"to rank {nxt}, from rank {prv} got {int(buf)}")
    except StopIteration:
        _report(rank, "send/recv", True, "(skipped: world size 1)")
    except Exception as e:
        ok = _report(
            rank,
            "send/recv",
            False,
            f"no answer from rank {prv} or rank {nxt} within {args.timeout:g}s ({type(e).__name__})",
        )
    if ok:
        dist.barrier()
        dist.destroy_process_group()
    print(f"[rank {rank}] selfcheck {'passed' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1
