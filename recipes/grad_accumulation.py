"""Gradient accumulation under DDP: k micro-batches, one gradient all-reduce per optimizer step.

    torchrun --standalone --nproc_per_node=2 -m recipes.grad_accumulation --micro-batches 3
    python -m recipes.grad_accumulation --no-use-no-sync     # the naive loop: k all-reduces a step

Each rank runs ``micro_batches`` forward/backward passes of
global_batch_size / (world_size * micro_batches) sequences and then one optimizer step. DDP
all-reduces gradients at the end of every backward pass, unless the backward runs inside
``ddp_model.no_sync()``: then gradients just accumulate locally in ``.grad``, and the next
synchronised backward all-reduces the accumulated sum. So: ``no_sync`` for all but the last
micro-batch of a step.

Two claims, both measured (tests/test_grad_accumulation.py):

- communication: a DDP communication hook counts the all-reduce rounds; with ``no_sync`` there is
  exactly one round per optimizer step (without it, one per micro-batch);
- equivalence: each micro-batch loss is divided by ``micro_batches``, so the accumulated gradient
  is the mean over the global batch, and k micro-batches on N ranks give the same update as one
  step on the whole global batch in one process.

Dividing by ``micro_batches`` is right here because every sequence has the same number of real
tokens. With padding or packing it is a mean of means; recipes/sharded_accumulation.py
normalises by the tokens of the whole step instead (its ``--loss-normalisation``), under
fully_shard, with the same test against one process.
"""

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from recipes.core.cli import run_cli
from recipes.core.config import TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_cpu, mean_over_ranks
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
class GradAccumulationConfig(TrainConfig):
    micro_batches: int = opt(2, "forward/backward passes per optimizer step on each rank", ge=1)
    use_no_sync: bool = opt(True, "skip the all-reduce on all but the last micro-batch (the point "
                                  "of this recipe)")


# --8<-- [start:counter]
@dataclass
class AllReduceCounter:
    """State for a DDP communication hook that counts what it all-reduces."""

    buckets: int = 0  # bucket all-reduces launched so far
    # backward passes that communicated, per step
    rounds_per_step: list[int] = field(default_factory=list)


def counting_allreduce_hook(
    counter: AllReduceCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    # DDP checks this signature's annotations at run time, which is why this module has no
    # `from __future__ import annotations` (it would turn them into strings).
    counter.buckets += 1
    return default_hooks.allreduce_hook(None, bucket)  # DDP's own behaviour: average over the world
# --8<-- [end:counter]


# --8<-- [start:train]
def train(cfg: GradAccumulationConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        micro_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size,
                                          cfg.micro_batches)
        precision = setup_precision(cfg.precision, world.device)
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        device_ids = [world.device.index] if world.device.type == "cuda" else None
        ddp_model = DDP(model, device_ids=device_ids)
        counter = AllReduceCounter()
        ddp_model.register_comm_hook(counter, counting_allreduce_hook)
        optimizer = make_adamw(ddp_model.parameters(), lr=cfg.lr, device=world.device)
        scaler = make_grad_scaler(world.device, precision)  # fp16: scale every micro-batch's loss
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # The loader yields one rank's share of a whole step; it is cut into micro-batches below,
        # so the samples of a step are the same as without accumulation.
        loader, sampler = distributed_loader(dataset, rank=world.rank, world_size=world.world_size,
                                             per_rank_batch_size=micro_batch * cfg.micro_batches,
                                             seed=cfg.seed)

        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                optimizer.zero_grad(set_to_none=True)
                rounds, step_loss = 0, torch.zeros((), device=world.device)
                micro = zip(inputs.split(micro_batch), targets.split(micro_batch))
                for i, (x, y) in enumerate(micro):
                    last = i == cfg.micro_batches - 1
                    # no_sync: accumulate into .grad locally; the last backward all-reduces the sum.
                    skip = not last and cfg.use_no_sync
                    sync = ddp_model.no_sync() if skip else contextlib.nullcontext()
                    before = counter.buckets
                    with sync:
                        with autocast(world.device, precision):
                            loss = lm_loss(ddp_model(x.to(world.device)), y.to(world.device))
                        loss = loss / cfg.micro_batches
                        scaler.scale(loss).backward()
                    rounds += counter.buckets > before
                    step_loss += loss.detach()
                scaler.step(optimizer)
                scaler.update()
            counter.rounds_per_step.append(rounds)
            losses.append(mean_over_ranks(step_loss))
            log.info("step %d loss %.4f all-reduce rounds %d time %.1f ms",
                     step, losses[-1], rounds, timer.durations[-1] * 1e3)

        return make_result(
            "grad_accumulation",
            world,
            losses,
            model.parameters(),
            timer,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            allreduce_rounds_per_step=counter.rounds_per_step,
            bucket_allreduces=counter.buckets,
            micro_batch_size=micro_batch,
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, GradAccumulationConfig, __doc__)
