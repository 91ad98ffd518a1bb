"""Under torchrun (2 processes, dp2): rank 1 dies after the mesh exists; rank 0 then waits in an all-reduce.

The run must end quickly (process-group timeout comm_timeout=5 s, or torchrun tearing the group down) with
rank 1 named as the first failure, never hang.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import make_cfg  # noqa: E402

from meshformer.parallel import init_parallel  # noqa: E402

env = init_parallel(make_cfg({"parallel_config.data_parallel": 2, "comm_timeout": 5}))
if env.rank == 1:
    os._exit(3)
env.all_reduce_sum_dp(torch.ones(1))
env.all_reduce_sum_dp(torch.ones(1))
print("rank 0 was not stopped", flush=True)
