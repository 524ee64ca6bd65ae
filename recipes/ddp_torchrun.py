"""DDP under torchrun: the canonical data-parallel training loop, equal to single-process training.

    torchrun --standalone --nproc_per_node=2 -m recipes.ddp_torchrun
    python -m recipes.ddp_torchrun                      # a world of 1: no torchrun needed

Multi-node: run the same command on every node; they meet at node 0's address.

    # static: each node knows its rank
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=node0 --master_port=29500 -m recipes.ddp_torchrun
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=1 --master_addr=node0 --master_port=29500 -m recipes.ddp_torchrun
    # elastic rendezvous: identical command everywhere, torchrun assigns node ranks
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=job42 --rdzv_backend=c10d --rdzv_endpoint=node0:29500 -m recipes.ddp_torchrun

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process it starts;
``join_world`` reads them. Each rank trains on global_batch_size / world_size sequences per step and
DDP averages the gradients, so with the same seed and global batch the losses are the same on any
number of ranks (tests/test_ddp_torchrun.py asserts it for worlds of 1, 2 and 3).

Pitfalls named where they bite below: ``sampler.set_epoch``, DDP's ``.module``, saving from rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.cli import run_cli
from recipes.core.config import TrainConfig, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, full_state_on_cpu, make_result, mean_over_ranks
from recipes.core.workload import build_model, distributed_loader, iterate_steps, lm_loss, make_dataset
from recipes.core.world import join_world

log = get_logger(__name__)


@dataclass
class DDPConfig(TrainConfig):
    """Nothing beyond the shared fields: this recipe is the baseline the others are compared with."""


# --8<-- [start:train]
def train(cfg: DDPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        # Same seed on every rank -> same initial weights; DDP also broadcasts rank 0's at construction.
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        ddp_model = DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=cfg.lr)
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=world.rank, world_size=world.world_size,
                                             per_rank_batch_size=per_rank_batch, seed=cfg.seed)
        log.info("DDP on %d rank(s), backend %s, %d sequences per rank per step",
                 world.world_size, world.backend, per_rank_batch)

        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):  # calls set_epoch
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                loss = lm_loss(ddp_model(inputs), targets)  # the local mean over this rank's sequences
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP averages gradients across ranks here, overlapped with backward
                optimizer.step()  # every rank applies the same averaged gradient: replicas stay equal
            losses.append(mean_over_ranks(loss))  # the global batch's loss, for logging only
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        # Pitfall: the trained weights live in ddp_model.module; save that (from rank 0 only), so the
        # checkpoint loads into a plain model without "module." prefixes.
        return make_result("ddp_torchrun", world, losses, model.parameters(), timer,
                           keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None)
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, DDPConfig, __doc__)
