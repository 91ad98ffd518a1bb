"""One torchrun launch per world size for the jobs of every parity file that shares it (tests/conftest.py
`shared_launches`): torch's import, the rendezvous and the process start-ups are paid once, not once per file.

usage: torchrun --nproc-per-node N tests/dist/launch_worker.py OUT DIR WORKER/JOB ...
WORKER names the worker whose `run_job` runs JOB: parity (parity_worker.py: CASE[:VARIANT]), ep (ep_worker.py:
JOB:CASE) or cp (cp_worker.py: JOB:CASE[:VARIANT]); each writes its files under DIR/WORKER, so a later launch
finds what an earlier one saved there. Rank 0 writes {WORKER: {its keys: ...}} into OUT (json), every rank's
findings merged.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cp_worker  # noqa: E402
import ep_worker  # noqa: E402
import parity_worker  # noqa: E402

WORKERS = {"parity": parity_worker, "ep": ep_worker, "cp": cp_worker}


def main() -> None:
    out_path, where, jobs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    results, env = {name: {} for name in WORKERS}, None
    for spec in jobs:
        name, _, job = spec.partition("/")
        (where / name).mkdir(parents=True, exist_ok=True)
        res, env = WORKERS[name].run_job(job, where / name)
        results[name].update(res)
        parity_worker.release_groups(env)
    gathered = env.all_gather_object(results)  # each job's metrics rank may differ: every rank's findings
    if env.rank == 0:
        out_path.write_text(
            json.dumps({name: {k: v for r in gathered for k, v in r[name].items()} for name in WORKERS})
        )
    env.shutdown()


if __name__ == "__main__":
    main()
