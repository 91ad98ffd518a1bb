"""Cross-check of the planner's model states on the real `parallelize` path, at any size, with no memory.

One rank of the configured layout is built the way a run builds it (train/step.py's build_parts steps: model
transforms, then `parallelize`: pipeline split, tensor parallelism, recompute, FSDP) on torch's fake process group
("fake" backend: collectives return at once) with every tensor a FakeTensor (shapes and dtypes, no storage); one
forward and backward make the gradients (pipelines: gradients shaped as the parameters, a schedule would wait on
its peers), one AdamW step makes its states, and their bytes are summed as a run sums them (train/memory.py). A
7B layout checks in seconds; tests/cli/test_memory.py holds the planner to it.

    python -m meshformer.planner.fake_check CONFIG --rank R [--world W] [--dotted.overrides ...]   # prints JSON

Run it in a fresh process: it initialises a process group.
"""

from __future__ import annotations

import argparse
import json
import sys


def fake_state_bytes(cfg, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from meshformer.backends.torch_private import fake_store, fake_tensor_mode
    from meshformer.dtypes import DTYPE
    from meshformer.models import build_model, materialize
    from meshformer.models.transforms import apply_model_transforms
    from meshformer.parallel import parallelize
    from meshformer.parallel.dims import ParallelDims
    from meshformer.parallel.env import ParallelEnv, build_meshes, check_placement
    from meshformer.train.optim import Optimizers
    from meshformer.train.step import make_loss_fn

    dims = ParallelDims.from_config(cfg, world)
    dist.init_process_group("fake", store=fake_store()(), rank=rank, world_size=world)
    try:
        mesh, flat = build_meshes(dims, "cpu")  # the run's meshes (init_parallel), on the fake process group
        env = ParallelEnv(dims=dims, rank=rank, backend="fake", mesh=mesh, flat_meshes=flat)
        check_placement(env)
        # build_parts's steps, with the allocation (materialize) on fake tensors: parallelize works on the meta
        # device as in a run.
        mc = cfg.model.model_config
        model = build_model(mc)
        apply_model_transforms(model, cfg)
        parts = parallelize(model, cfg, env, make_loss_fn(cfg))
        with fake_tensor_mode()(allow_non_fake_inputs=True):
            for part in parts.parts:
                materialize(part, torch.device("cpu"), cfg.seed, DTYPE[mc.param_init_type])
            params = list(parts.parameters())
            # One real (fake) forward and backward of a micro-batch makes the gradients as a run makes them (a
            # vocab-parallel embedding's gradient comes out whole, for one).
            if dims.pp == 1:
                tokens = torch.randint(mc.vocab_size, (1, mc.seq_length + 1))
                parts.forward_backward(tokens[:, :-1], tokens[:, 1:], 1, 1.0)
            else:  # a pipeline schedule would wait for its peers' sends: gradients shaped as the parameters
                for p in params:
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
            opt = Optimizers(parts.parts, cfg)
            opt.step()

            def nbytes(tensors) -> int:
                kept = {id(t): t for t in tensors if t is not None}  # distinct tensors (ids held alive)
                locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in kept.values()]
                return sum(t.numel() * t.element_size() for t in locals_)

            return {
                "stage": env.pp_rank,
                "params_bytes": nbytes(params),
                "grads_bytes": nbytes(p.grad for p in params),
                "optimizer_bytes": nbytes(opt.state_tensors()),
            }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import meshformer.models  # noqa: F401  (the families' config classes, before the config loads)
    from meshformer.config.load import load_config
    from meshformer.interop.base_model import BASE_MODEL_SOURCES
    from meshformer.train.finetune import apply_finetune_base

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=None, help="default: the layout's product")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    apply_finetune_base(cfg, BASE_MODEL_SOURCES)  # a fine-tune's model is load_checkpoint's
    pc = cfg.parallel_config
    world = args.world or pc.data_parallel * pc.context_parallel * pc.model_parallel * pc.pipeline_stage
    print(json.dumps(fake_state_bytes(cfg, args.rank, world)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
