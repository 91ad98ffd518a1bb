"""`meshformer train ARGS` under torchrun, with rank 1 struck at its 4th optimizer step: FAULT is `die` (SIGKILL),
`stop` (SIGSTOP: frozen with every thread) or `hang` (its main thread sleeps; its heartbeat thread goes on).

Usage: torchrun ... fault_rank.py FAULT train CONFIG [overrides]
"""

import os
import signal
import sys
import time

import meshformer.train.trainer as trainer
from meshformer.cli.main import main

fault = sys.argv.pop(1)
real_step, calls = trainer.train_step, [0]


def struck_step(*args, **kwargs):
    calls[0] += 1
    if os.environ.get("RANK") == "1" and calls[0] == 4:
        if fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3600)
    return real_step(*args, **kwargs)


trainer.train_step = struck_step
sys.exit(main(sys.argv[1:]))
