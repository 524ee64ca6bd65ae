"""ZeRO-1: DDP with ZeroRedundancyOptimizer, each rank keeps AdamW state for its partition only.

    torchrun --standalone --nproc_per_node=2 -m recipes.zero
    torchrun --standalone --nproc_per_node=2 -m recipes.zero --optimizer adamw  # plain DDP

DDP still replicates the parameters and all-reduces full gradients; only the optimizer state is
partitioned. Each rank runs AdamW on the parameters it owns, then broadcasts them to the others, so
the replicas stay equal and the training equals DDP's (tests/test_zero.py). AdamW keeps two fp32
tensors per parameter (exp_avg, exp_avg_sq), 2x the parameter bytes: ZeRO-1 divides that part by N.

The partition is by whole parameters (greedy, largest first, onto the least-loaded rank), so one
rank can hold up to one parameter's state more than 1/N: a model with a few huge tensors (a large
vocabulary embedding) balances worse than one with many small ones.
``extras["optimizer_numel_per_rank"]`` shows the split. Pitfalls named where they bite: the
optimizer state dict must be consolidated by every rank before rank 0 saves it; clipping needs no
collective here because DDP's gradients are full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.cli import run_cli
from recipes.core.config import TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import all_ranks, full_state_on_cpu, mean_over_ranks
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
from recipes.core.world import join_world

log = get_logger(__name__)


@dataclass
class ZeroConfig(TrainConfig):
    optimizer: Literal["zero", "adamw"] = opt(
        "zero",
        "zero = ZeroRedundancyOptimizer(AdamW), 1/N of the state per rank; adamw = plain DDP "
        "baseline",
    )
    max_grad_norm: float = opt(
        0.0, "clip the total gradient norm with torch.nn.utils.clip_grad_norm_ (0 = off)", ge=0
    )


# --8<-- [start:train]
def train(cfg: ZeroConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        precision = setup_precision(cfg.precision, world.device)
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        ddp_model = DDP(
            model, device_ids=[world.device.index] if world.device.type == "cuda" else None
        )
        if cfg.optimizer == "zero":
            # Same arguments as AdamW, plus the class: each rank builds an AdamW over its own
            # partition. fused=: one kernel per partition on CUDA, like make_adamw (None = torch's
            # default).
            optimizer = ZeroRedundancyOptimizer(
                ddp_model.parameters(),
                optimizer_class=torch.optim.AdamW,
                lr=cfg.lr,
                fused=True if world.device.type == "cuda" else None,
            )
            owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
        else:
            optimizer = make_adamw(ddp_model.parameters(), lr=cfg.lr, device=world.device)
            owned = list(ddp_model.parameters())
        scaler = make_grad_scaler(world.device, precision)  # a pass-through unless fp16
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(
            dataset,
            rank=world.rank,
            world_size=world.world_size,
            per_rank_batch_size=per_rank_batch,
            seed=cfg.seed,
        )
        log.info(
            "DDP + %s on %d rank(s): this rank updates %d of %d parameter tensors",
            cfg.optimizer,
            world.world_size,
            len(owned),
            len(list(model.parameters())),
        )

        losses, grad_norms, timer = [], [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                with autocast(world.device, precision):
                    loss = lm_loss(ddp_model(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()  # DDP all-reduces FULL gradients: every rank has all
                if cfg.max_grad_norm > 0:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                    # Gradients are replicated, so the local norm IS the global norm: no collective
                    # needed (unlike FSDP, where each rank holds a shard: see recipes/fsdp.py).
                    grad_norms.append(
                        float(
                            torch.nn.utils.clip_grad_norm_(
                                ddp_model.parameters(), cfg.max_grad_norm
                            )
                        )
                    )
                # ZeRO: update the owned partition, broadcast it to the others
                scaler.step(optimizer)
                scaler.update()
            losses.append(mean_over_ranks(loss))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        # after step, before zero_grad
        extras = {
            "memory_per_rank": all_ranks(model_state_bytes(ddp_model, optimizer)),
            "optimizer_numel_per_rank": all_ranks(sum(p.numel() for p in owned)),
        }
        if cfg.max_grad_norm > 0:
            extras["grad_norms"] = grad_norms
        if cfg.optimizer == "zero":
            # Pitfall: optimizer.state_dict() on rank 0 alone raises (or returns a stale state).
            # Every rank must first send its partition: consolidate_state_dict is a collective.
            optimizer.consolidate_state_dict(to=0)
            if world.is_main:
                extras["consolidated_optimizer_states"] = len(optimizer.state_dict()["state"])
        return make_result(
            "zero",
            world,
            losses,
            model.parameters(),
            timer,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            **extras,
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, ZeroConfig, __doc__)
