"""The distillation loss on vocab shards (tests/parity/test_distill_tp.py).

usage: torchrun --nproc-per-node 2 tests/dist/distill_tp_worker.py OUT
Every case builds the same student and teacher LM heads (`heads`), splits both with the project's `vocab_head`
tensor-parallel style (parallel/tp.py: logits stay DTensors sharded on the vocabulary) and computes
train/distill_loss.py's `distill_loss_sum` under `loss_parallel`, as the step runs its cross-entropy, while
CommDebugMode counts the collectives. Each case runs in float32 and in float64.
Rank 0 writes {"case:dtype": {"loss", "student_grad", "all_gathers", "local_vocab"}} into OUT (json): the loss, the
student head's whole gradient, how many all-gathers ran, and the vocabulary rows this rank's head held.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

HIDDEN, TEACHER_HIDDEN, ROWS, SEQ = 16, 24, 2, 6
# name -> (vocabulary, distill_config fields)
CASES = {
    "forward_kl": (96, dict(loss="forward_kl")),
    "reverse_kl_t2": (96, dict(loss="reverse_kl", temperature=2.0)),
    "jsd_b03_t07": (96, dict(loss="jsd", beta=0.3, temperature=0.7)),
    "jsd_top_k5": (96, dict(loss="jsd", beta=0.6, top_k=5)),
    "reverse_kl_top_k40_alpha": (96, dict(loss="reverse_kl", top_k=40, alpha=0.4)),
    "forward_kl_alpha_uneven": (97, dict(loss="forward_kl", alpha=0.25, temperature=1.5)),
    "jsd_top_k3_uneven": (97, dict(loss="jsd", beta=0.5, top_k=3)),
}


DTYPES = ("float32", "float64")


def config(fields: dict) -> SimpleNamespace:
    base = dict(loss="forward_kl", beta=0.5, temperature=1.0, alpha=1.0, top_k=None)
    return SimpleNamespace(**{**base, **fields})


def heads(vocab: int, dtype: torch.dtype = torch.float32):
    """(student head, teacher head, student hidden states, teacher hidden states, labels), the same on every rank."""
    g = torch.Generator().manual_seed(vocab)
    student = torch.nn.Linear(HIDDEN, vocab, bias=False)
    teacher = torch.nn.Linear(TEACHER_HIDDEN, vocab, bias=False)
    with torch.no_grad():
        student.weight.copy_(torch.randn(vocab, HIDDEN, generator=g))
        teacher.weight.copy_(torch.randn(vocab, TEACHER_HIDDEN, generator=g))
    hs = torch.randn(ROWS, SEQ, HIDDEN, generator=g)
    ht = torch.randn(ROWS, SEQ, TEACHER_HIDDEN, generator=g)
    labels = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    labels[:, :2] = -100  # the prompt
    labels[-1, -1] = -100  # padding
    return student.to(dtype), teacher.to(dtype), hs.to(dtype), ht.to(dtype), labels


def _case(name: str, dtype: torch.dtype, mesh) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from meshformer.parallel.tp import make_style
    from meshformer.train.distill_loss import distill_loss_sum

    vocab, fields = CASES[name]
    student, teacher, hs, ht, labels = heads(vocab, dtype)
    parallelize_module(student, mesh, make_style("vocab_head", False))
    parallelize_module(teacher, mesh, make_style("vocab_head", False))
    comm = CommDebugMode()
    with comm, loss_parallel():
        loss, _ = distill_loss_sum(student(hs), teacher(ht).detach(), labels, config(fields))
        loss.backward()
    counts = comm.get_comm_counts()
    gathers = sum(n for op, n in counts.items() if "all_gather" in str(op))
    return {
        "loss": float(loss),
        "student_grad": student.weight.grad.full_tensor().tolist(),
        "all_gathers": gathers,
        "local_vocab": student.weight.to_local().shape[0],
    }


def main(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {f"{name}:{d}": _case(name, getattr(torch, d), mesh) for name in CASES for d in DTYPES}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
