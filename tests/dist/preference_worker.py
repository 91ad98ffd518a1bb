"""Under torchrun: the preference parity cases (tests/parity/test_preference_layouts.py), as parity_worker.py runs
the SFT ones, plus the context-parallel layouts (tests/dist/cp_worker.py has their SFT cases).

usage: torchrun --nproc-per-node N tests/dist/preference_worker.py OUT.json CASE:VARIANT ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import parity_worker  # noqa: E402

P = harness.P
# Context parallelism: every row split over 2 ranks, each pair's log-probs summed over them
harness.CASES.update(
    {
        "cp2": ({P + "context_parallel": 2}, 1),
        "cp2_accum": ({P + "context_parallel": 2}, 2),
    }
)

if __name__ == "__main__":
    parity_worker.main()
