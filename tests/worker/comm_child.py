"""One worker process of the multi-process all-reduce test (run as a script by tests/worker/test_comm.py).

usage: comm_child.py URL JOB WORKER WORLD STEPS DIR — reads DIR/in-{worker}-{step}.npy, writes
DIR/out-{worker}-{step}.npy, or DIR/err-{worker}.txt with the traceback.
"""

import sys
import traceback
from pathlib import Path

import numpy as np

from elastune_worker.comm import StorageAllReduce, make_channel


def main(url: str, job: str, worker: int, world: int, steps: int, folder: Path) -> None:
    channel = make_channel(url)
    try:
        ar = StorageAllReduce(channel, job, worker, world, timeout_s=15.0)
        for step in range(steps):
            grad = np.load(folder / f"in-{worker}-{step}.npy")
            np.save(folder / f"out-{worker}-{step}.npy", ar.allreduce_mean(step, grad))
    finally:
        channel.close()


if __name__ == "__main__":
    url, job, worker, world, steps, folder = sys.argv[1:]
    try:
        main(url, job, int(worker), int(world), int(steps), Path(folder))
    except BaseException:
        Path(folder, f"err-{worker}.txt").write_text(traceback.format_exc())
        raise
