"""nn.DataParallel: one process drives every visible GPU. Know it to recognise it; use DDP instead.

    python -m recipes.data_parallel
    CUDA_VISIBLE_DEVICES=0,1 python -m recipes.data_parallel --global-batch-size 16

Each forward, ``nn.DataParallel`` splits the batch along dim 0 across the GPUs, copies the module to
each of them, runs the replicas in threads of this one process, and gathers the outputs on GPU 0;
backward sums the gradients back onto GPU 0's parameters. It is one line to add, and that is its
only advantage. Why DDP (recipes.ddp_torchrun) is preferred, even on a single machine:

- one process and the GIL drive every GPU: Python overhead grows with the GPU count;
- the model is re-broadcast to every GPU on every forward, and outputs/gradients funnel through GPU
  0, which therefore needs more memory than the others and becomes the bottleneck;
- no overlap of gradient communication with backward (DDP all-reduces buckets while backward runs);
- one machine only; PyTorch's docs recommend DDP "even if there is only a single node".

With no GPU, DataParallel simply calls the module on CPU: this recipe then runs on one device and
says so. The batch is the whole global batch (there is one process): the loss equals single-device
training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from recipes.core.cli import run_cli
from recipes.core.config import TrainConfig, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, param_checksum, peak_memory_bytes
from recipes.core.state import full_state_on_cpu
from recipes.core.speed import autocast, make_adamw, make_grad_scaler, setup_precision
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)

log = get_logger(__name__)


@dataclass
class DataParallelConfig(TrainConfig):
    """The shared fields; ``backend`` and ``timeout_s`` are unused: DataParallel has no process
    group."""


# --8<-- [start:train]
def train(cfg: DataParallelConfig) -> RecipeResult:
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    if gpus:
        # each GPU gets an equal slice of the batch
        per_rank_batch_size(cfg.global_batch_size, gpus)
        log.info("DataParallel over %d GPU(s); outputs gather on %s", gpus, device)
    else:
        log.info("no GPU visible: DataParallel calls the module directly on CPU (one device)")
    precision = setup_precision(cfg.precision, device)
    # parameters must live on device_ids[0]
    model = build_model(cfg.model, seed=cfg.seed, device=device)
    dp_model = nn.DataParallel(model)
    optimizer = make_adamw(dp_model.parameters(), lr=cfg.lr, device=device)
    scaler = make_grad_scaler(device, precision)
    dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    # One process reads the whole global batch (a "world" of 1, in the same order as the DDP
    # recipes).
    loader, sampler = distributed_loader(
        dataset, rank=0, world_size=1, per_rank_batch_size=cfg.global_batch_size, seed=cfg.seed
    )
    losses, timer = [], StepTimer(device)
    for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
        with timer:
            # Scattered along dim 0 to the GPUs; logits come back gathered on GPU 0.
            # autocast reaches the replicas: DataParallel's threads re-enter the caller's state.
            with autocast(device, precision):
                loss = lm_loss(dp_model(inputs.to(device)), targets.to(device))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        losses.append(loss.item())
        log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

    return RecipeResult(
        recipe="data_parallel",
        world_size=1,
        backend="none",
        device=str(device),
        losses=losses,
        param_checksum=param_checksum(model.parameters()),
        seconds_per_step=timer.seconds_per_step,
        peak_memory_bytes=peak_memory_bytes(device),
        extras={"gpus": gpus},
        **Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision).measure(
            timer.seconds_per_step, device, max(gpus, 1) if device.type == "cuda" else 1
        ),
        # Pitfall: the weights live in dp_model.module; save that, not dp_model (its keys get
        # "module.").
        final_state=full_state_on_cpu(dp_model) if cfg.keep_final_state else None,
    )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, DataParallelConfig, __doc__)
