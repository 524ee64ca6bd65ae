import os

import torch

# Spawned ranks inherit this: one thread per rank keeps a 2-core machine from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
