"""Lightning Fabric: the raw DDP loop of recipes.ddp_torchrun, converted to Fabric line by line;
same losses.

    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_fabric
    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_fabric \\
        --accumulate-grad-batches 2 --checkpoint-every-n-steps 3
    python -m recipes.lightning_fabric                    # a world of 1: no torchrun needed

Fabric keeps your loop and takes over the plumbing: device placement, the DDP wrapper, the sampler's
epoch, gradient sync, rank-0 saving. The smallest migration from raw PyTorch, line by line (the docs
page shows both loops side by side; tests/test_lightning_fabric.py proves they give the same
losses):

    raw PyTorch (recipes/ddp_torchrun.py)          Fabric (this file)
    ---------------------------------------------  ---------------------------------------------
    +                                              fabric = L.Fabric(accelerator=..., devices=...,
                                                                     strategy="ddp")
    +                                              fabric.launch()
    model = build_model(..., device=world.device)  model = build_model(...)  # Fabric moves it
    ddp_model = DDP(model, device_ids=[...])       (gone)
    optimizer = AdamW(ddp_model.parameters(), lr)  optimizer = AdamW(model.parameters(), lr)
    +                                              ddp_model, optimizer = fabric.setup(model,
                                                                                      optimizer)
    loader, sampler = distributed_loader(...)      loader, sampler = distributed_loader(...)
    +                                              loader = fabric.setup_dataloaders(
                                                       loader, use_distributed_sampler=False)
    inputs, targets = inputs.to(dev), ....to(dev)  (gone: the loader moves batches to the device)
    loss.backward()                                fabric.backward(loss)
    with ddp_model.no_sync(): (accumulation)       with fabric.no_backward_sync(ddp_model,
                                                                                enabled=...):
    mean_over_ranks(loss)                          fabric.all_reduce(loss, reduce_op="mean")
    if rank == 0: torch.save(model.state_dict(),   fabric.save(p, {"model": ddp_model,
                             p)                                    "optimizer": ..., "step": ...})
    model.load_state_dict(torch.load(p))           fabric.load(p, state)

In a script of your own, ``fabric.launch()`` also creates the process group (and, under plain python
with ``devices=N``, starts the N processes). Here ``join_world`` creates it first, with the
project's timeouts and teardown, and Fabric uses the group it finds: one harness for every recipe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.paths import input_file_problem, output_dir_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_cpu
from recipes.core.speed import lightning_precision, make_adamw
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

import lightning as L

log = get_logger(__name__)


@dataclass
class FabricConfig(TrainConfig):
    # Lightning's own precision names (plus auto), not the cookbook's: Lightning users know these.
    precision: Literal[  # type: ignore[assignment]
        "auto", "32-true", "bf16-mixed", "16-mixed"
    ] = opt(
        "auto", "Fabric precision; auto = bf16-mixed on a GPU, 32-true on CPU; 16-mixed needs CUDA"
    )
    accumulate_grad_batches: int = opt(
        1, "micro-batches per optimizer step (the global batch stays global_batch_size)", ge=1
    )
    gradient_clip_val: float = opt(
        0.0, "clip the global gradient norm to this value; 0 = off", ge=0
    )
    checkpoint_every_n_steps: int = opt(
        0, "fabric.save a checkpoint every N optimizer steps; 0 = never", ge=0
    )
    checkpoint_dir: str = opt("checkpoints/lightning_fabric", "where checkpoints go (step-N.ckpt)")
    resume_from: str = opt(
        "", "checkpoint to resume from (fabric.load): training goes on at its step"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint_every_n_steps > self.steps:  # it would save nothing, and say nothing
            raise RecipeError(f"checkpoint_every_n_steps={self.checkpoint_every_n_steps} > "
                              f"steps={self.steps}: no checkpoint would be written; use "
                              f"--checkpoint-every-n-steps {self.steps} or less (0 = none)")


# --8<-- [start:train]
def train(cfg: FabricConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        precision, core_precision = lightning_precision(cfg.precision, world.device)
        if precision == "16-mixed" and world.device.type == "cpu":
            # Fabric would silently switch to bf16-mixed: say it instead of measuring the wrong
            # thing.
            raise RecipeError(
                "precision '16-mixed' needs CUDA (fp16 autocast does not run on CPU); "
                "use --precision bf16-mixed or 32-true"
            )
        k = cfg.accumulate_grad_batches
        micro_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size, micro_batches=k)
        # Every rank reads --resume-from; rank 0 writes the checkpoints: before any step, not at
        # the first save or in fabric.load's traceback.
        refuse(cfg.resume_from and input_file_problem(
                   cfg.resume_from, "--resume-from", "a step-N.ckpt file that fabric.save wrote"),
               cfg.checkpoint_every_n_steps and world.is_main
               and output_dir_problem(cfg.checkpoint_dir, "--checkpoint-dir"))
        fabric = L.Fabric(
            accelerator="cuda" if world.device.type == "cuda" else "cpu",
            devices=world.local_world_size,
            num_nodes=world.world_size // world.local_world_size,
            strategy="ddp",
            precision=precision,
        )
        # the process group exists already (join_world): Fabric only takes its place in it
        fabric.launch()

        # on CPU: fabric.setup moves it to fabric.device
        model = build_model(cfg.model, seed=cfg.seed)
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)  # fused on CUDA
        # DDP wrapper + precision, in one call
        ddp_model, optimizer = fabric.setup(model, optimizer)
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(
            dataset,
            rank=world.rank,
            world_size=world.world_size,
            per_rank_batch_size=micro_batch,
            seed=cfg.seed,
        )
        # use_distributed_sampler=False: keep our sampler (the raw recipe's data order); Fabric
        # still moves each batch to the device and calls sampler.set_epoch once per pass over the
        # loader.
        loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)

        start_step = 0
        if cfg.resume_from:
            state = {"model": ddp_model, "optimizer": optimizer, "step": 0}
            # restores model and optimizer in place, on every rank
            fabric.load(cfg.resume_from, state)
            start_step = state["step"]
        log.info(
            "Fabric DDP on %d rank(s), %d micro-batch(es) of %d sequences per rank per step%s",
            world.world_size,
            k,
            micro_batch,
            f", resumed at step {start_step}" if start_step else "",
        )

        losses, timer = [], StepTimer(world.device)
        micro_batches: list = []
        # sampler.set_epoch as in raw
        for index, batch in iterate_steps(loader, sampler, cfg.steps * k):
            step = index // k
            if step < start_step:
                # resuming: the data order is the same, so skip what the checkpoint has seen
                continue
            micro_batches.append(batch)
            if len(micro_batches) < k:
                continue
            with timer:
                local_loss = torch.zeros((), device=fabric.device)
                for i, (inputs, targets) in enumerate(micro_batches):
                    # Gradient accumulation: only the last micro-batch's backward all-reduces.
                    # Pitfall: the forward must run inside the context too, or DDP prepares a
                    # gradient sync anyway.
                    with fabric.no_backward_sync(ddp_model, enabled=i < k - 1):
                        loss = lm_loss(ddp_model(inputs), targets)
                        # mean over k equal micro-batches = mean over the batch
                        fabric.backward(loss / k)
                    local_loss += loss.detach() / k
                # the norm of the averaged (global) gradient, as in Lightning
                if cfg.gradient_clip_val:
                    fabric.clip_gradients(ddp_model, optimizer, max_norm=cfg.gradient_clip_val)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            micro_batches = []
            # for logging only
            losses.append(float(fabric.all_reduce(local_loss, reduce_op="mean")))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)
            if cfg.checkpoint_every_n_steps and (step + 1) % cfg.checkpoint_every_n_steps == 0:
                # Every rank calls save; for DDP Fabric writes one full, unwrapped state from rank
                # 0.
                fabric.save(
                    os.path.join(cfg.checkpoint_dir, f"step-{step + 1}.ckpt"),
                    {"model": ddp_model, "optimizer": optimizer, "step": step + 1},
                )

        result = make_result(
            "lightning_fabric",
            world,
            losses,
            model.parameters(),
            timer,
            start_step=start_step,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, core_precision),
        )
        # Pitfall: free the DDP wrapper while the process group is alive. Its reducer holds the
        # group; if the reducer goes last (after join_world destroyed the group), it destroys the
        # gloo group from Python garbage collection, and that can deadlock at exit (4 of 6 torchrun
        # runs hung on torch 2.13).
        del ddp_model, optimizer
        return result
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, FabricConfig, __doc__)
