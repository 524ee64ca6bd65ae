import os

import torch

# Spawned ranks inherit this: one thread per rank keeps a 2-core machine from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: two test processes per CPU core. A test here spends much of its time waiting
    (ranks starting up and polling, timeouts it asserts, subprocesses), which a second test per
    core fills: with one per core, a 2-core run left about 40% of the CPU idle."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 * (cores or 1)
