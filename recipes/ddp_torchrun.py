"""DDP under torchrun: the canonical data-parallel training loop, equal to single-process training.

    torchrun --standalone --nproc_per_node=2 -m recipes.ddp_torchrun
    python -m recipes.ddp_torchrun                      # a world of 1: no torchrun needed
    python -m recipes.ddp_torchrun --model 100m --global-batch-size 64 --compile   # on a GPU: fast

Multi-node: run the same command on every node; they meet at node 0's address.

    # static: each node knows its rank (node 1 runs the same with --node_rank=1)
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=node0 --master_port=29500 \\
        -m recipes.ddp_torchrun
    # elastic rendezvous: identical command everywhere, torchrun assigns node ranks
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=job42 --rdzv_backend=c10d \\
        --rdzv_endpoint=node0:29500 -m recipes.ddp_torchrun

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process it starts;
``join_world`` reads them. Each rank trains on global_batch_size / world_size sequences per step and
DDP averages the gradients, so with the same seed and global batch the losses are the same on any
number of ranks (tests/test_ddp_torchrun.py asserts it for worlds of 1, 2 and 3).

Fast by default: on a GPU ``--precision auto`` trains in bf16 autocast with fp32 master
weights, AdamW is fused, and ``--compile`` compiles each block before DDP wraps the model
(recipes/core/speed.py). The result reports global tokens/s and MFU. ``--precision fp32`` is the
exact reference the tests pin.

Pitfalls named where they bite below: ``sampler.set_epoch``, DDP's ``.module``, saving from rank 0
only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.cli import run_cli
from recipes.core.config import CompileOption, TrainConfig, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import (
    apply_compile,
    autocast,
    compile_loss,
    make_adamw,
    make_grad_scaler,
    setup_precision,
)
from recipes.core.state import all_ranks, full_state_on_cpu, mean_over_ranks
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world

log = get_logger(__name__)


@dataclass
class DDPConfig(CompileOption, TrainConfig):
    """The shared fields and --compile: this recipe is the baseline the others are compared with."""


# --8<-- [start:train]
def train(cfg: DDPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        precision = setup_precision(cfg.precision, world.device)  # auto: bf16 on a GPU, fp32 on CPU
        # Same seed on every rank -> same initial weights; DDP also broadcasts rank 0's at
        # construction.
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        # before DDP: DDP then wraps compiled blocks, its hooks stay outside the graphs
        if cfg.compile:
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
        # --compile also fuses the loss (recipes.core.speed.compile_loss)
        loss_fn = compile_loss(lm_loss, backend=cfg.compile_backend) if cfg.compile else lm_loss
        ddp_model = DDP(
            model, device_ids=[world.device.index] if world.device.type == "cuda" else None
        )
        optimizer = make_adamw(ddp_model.parameters(), lr=cfg.lr, device=world.device)
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
            "DDP on %d rank(s), backend %s, %s, %d sequences per rank per step",
            world.world_size,
            world.backend,
            precision,
            per_rank_batch,
        )

        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):  # calls set_epoch
            with timer:
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                with autocast(world.device, precision):  # forward and loss only; backward follows
                    # the mean over this rank's sequences
                    loss = loss_fn(ddp_model(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                # DDP averages gradients here, overlapped with backward
                scaler.scale(loss).backward()
                scaler.step(optimizer)  # every rank applies the same averaged gradient
                scaler.update()
            losses.append(mean_over_ranks(loss))  # the global batch's loss, for logging only
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        # Pitfall: the trained weights live in ddp_model.module; save that (from rank 0 only), so
        # the checkpoint loads into a plain model without "module." prefixes.
        return make_result(
            "ddp_torchrun",
            world,
            losses,
            model.parameters(),
            timer,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            # the baseline of the sharding recipes' "1/N": every rank holds all of it
            memory_per_rank=all_ranks(model_state_bytes(ddp_model, optimizer)),
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, DDPConfig, __doc__)
