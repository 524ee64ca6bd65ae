"""Lightning Fabric: the raw DDP loop of recipes.ddp_torchrun, converted to Fabric line by line;
same losses.

    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_fabric
    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_fabric \\
        --accumulate-grad-batches 2 --checkpoint-every-n-steps 3
    python -m recipes.lightning_fabric                    # a world of 1: no torchrun needed

Copy with it: recipes/toy.py, recipes/dist_setup.py, recipes/options.py (the command line, from
the config).

Fabric keeps your loop and takes over the plumbing: device placement, the DDP wrapper, the sampler's
epoch, gradient sync, rank-0 saving. The smallest migration from raw PyTorch, line by line (the docs
page shows the diff of the two loops; tests/test_lightning_fabric.py proves they give the same
losses and weights):

    raw PyTorch (recipes/ddp_torchrun.py)          Fabric (this file)
    ---------------------------------------------  ---------------------------------------------
    +                                              fabric = L.Fabric(accelerator=..., devices=...,
                                                                     strategy="ddp")
    +                                              fabric.launch()
    model = build_model(..., device=device)        model = build_model(...)  # Fabric moves it
    model = DDP(model, device_ids=[...])           (gone)
    optimizer = AdamW(model.parameters(), lr)      optimizer = AdamW(model.parameters(), lr)
    +                                              model, optimizer = fabric.setup(model,
                                                                                  optimizer)
    loader = DataLoader(..., sampler=sampler)      the same, then loader = fabric.setup_dataloaders(
                                                       loader, use_distributed_sampler=False)
    sampler.set_epoch(epoch)                       (gone: Fabric's loader calls it)
    inputs, targets = inputs.to(dev), ....to(dev)  (gone: the loader moves batches to the device)
    loss.backward()                                fabric.backward(loss)
    with model.no_sync(): (accumulation)           with fabric.no_backward_sync(model,
                                                                            enabled=...):
    dist.all_reduce(loss, op=ReduceOp.AVG)         fabric.all_reduce(loss, reduce_op="mean")
    if rank == 0: torch.save(                      fabric.save(p, {"model": model,
        model.module.state_dict(), p)                  "optimizer": ..., "step": ...})
    model.load_state_dict(torch.load(p))           fabric.load(p, state)

In a script of your own, ``fabric.launch()`` also creates the process group (and, under plain python
with ``devices=N``, starts the N processes). Here ``setup_distributed`` creates it first, from
torchrun's variables (or Slurm's), and Fabric uses the group it finds: the same launch as every
other recipe.
"""

from __future__ import annotations

import argparse
import os
import pickle
from dataclasses import dataclass

import lightning as L
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed")


@dataclass
class FabricConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    # Lightning's own precision names (plus auto): Lightning users know these
    precision: str = option(
        "auto",
        "Fabric precision; auto: bf16-mixed on a GPU, 32-true on CPU; 16-mixed needs CUDA",
        choices=PRECISIONS,
    )
    # Fabric's accumulation and clipping calls (no_backward_sync, clip_gradients) are part of
    # what this recipe maps from the raw loop: they stay here
    accumulate_grad_batches: int = option(
        1,
        "micro-batches per optimizer step (the global batch stays global_batch_size)",
        at_least=1,
    )
    gradient_clip_val: float = option(
        0.0,
        "clip the global gradient norm to this value (fabric.clip_gradients); 0: off",
        at_least=0,
    )
    checkpoint_every_n_steps: int = option(
        0, "fabric.save a checkpoint every N optimizer steps; 0: never", at_least=0
    )
    checkpoint_dir: str = option(
        "checkpoints/lightning_fabric", "where checkpoints go (step-N.ckpt)"
    )
    resume_from: str = option(
        "", "checkpoint to resume from (fabric.load): training goes on at its step"
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        if self.checkpoint_every_n_steps > self.steps:  # it would save nothing, and say nothing
            raise ValueError(
                f"checkpoint_every_n_steps={self.checkpoint_every_n_steps} > "
                f"steps={self.steps}: no checkpoint would be written; use "
                f"--checkpoint-every-n-steps {self.steps} or less (0 = none)"
            )


def _check_paths(cfg: FabricConfig) -> None:
    """Every rank reads --resume-from and rank 0 writes into --checkpoint-dir: both checked on
    every rank before joining, so that all refuse together, not at the first save or in
    fabric.load's traceback."""
    what = "a step-N.ckpt file that fabric.save wrote"
    if cfg.resume_from and os.path.isdir(cfg.resume_from):
        raise ValueError(f"--resume-from {cfg.resume_from} is a directory, not a file; pass {what}")
    if cfg.resume_from and not os.path.exists(cfg.resume_from):
        raise ValueError(f"--resume-from {cfg.resume_from} does not exist; pass {what}")
    folder = cfg.checkpoint_dir
    if cfg.checkpoint_every_n_steps and os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(
            f"--checkpoint-dir {folder} is a file; name a directory (created if missing)"
        )


# --8<-- [start:train]
def train(cfg: FabricConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank;
    a resumed run: of the steps after the checkpoint's)."""
    _check_paths(cfg)
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        rank, world_size, k = world.rank, world.world_size, cfg.accumulate_grad_batches
        if cfg.global_batch_size % (world_size * k):
            n = world_size * k
            lower = max(n, cfg.global_batch_size - cfg.global_batch_size % n)
            parts = f"{world_size} ranks" + (f" x {k} micro-batches" if k > 1 else "")
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{parts}; use a multiple of {n}, e.g. {lower} or {lower + n}"
            )
        per_rank_batch = cfg.global_batch_size // world_size  # k micro-batches of it a step
        use_cuda = world.device.type == "cuda"
        precision = cfg.precision
        if precision == "auto":
            bf16 = use_cuda and torch.cuda.is_bf16_supported()
            precision = "bf16-mixed" if bf16 else "32-true"
        if precision == "16-mixed" and not use_cuda:
            # Fabric would silently switch to bf16-mixed: say it instead of training in another
            raise ValueError(
                "precision '16-mixed' needs CUDA (fp16 autocast does not run on "
                "CPU); use --precision bf16-mixed or 32-true"
            )
        if use_cuda and precision == "32-true":  # fp32 means fp32: no TF32 (a process-wide switch)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        fabric = L.Fabric(
            accelerator="cuda" if use_cuda else "cpu",
            devices=local_world_size,
            num_nodes=world_size // local_world_size,
            strategy="ddp",
            precision=precision,
        )
        fabric.launch()  # the process group exists already: Fabric only takes its place in it

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed)  # on the CPU: fabric.setup moves it
        loss_fn = lm_loss
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        model, optimizer = fabric.setup(model, optimizer)  # DDP wrapper + precision, one call
        start_step = 0
        if cfg.resume_from:
            state = {"model": model, "optimizer": optimizer, "step": 0}
            try:  # restores model and optimizer in place, on every rank
                fabric.load(cfg.resume_from, state)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # a truncated file
                raise ValueError(
                    f"--resume-from {cfg.resume_from} cannot be read as a checkpoint"
                    f" ({str(exc).splitlines()[0]})"
                ) from None  # every rank alike
            start_step = state["step"]
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
        )
        # use_distributed_sampler=False: keep our sampler (the raw recipe's data order); Fabric
        # moves each batch to the device, and calls sampler.set_epoch(n) on its n-th pass
        loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)

        losses, step = [], 0
        while step < cfg.steps:
            for inputs, targets in loader:  # a new epoch's order each pass: set_epoch is done
                if step == cfg.steps:
                    break
                if step < start_step:  # resuming: the same data order, so skip what it saw
                    step += 1
                    continue
                optimizer.zero_grad(set_to_none=True)
                local_loss = torch.zeros((), device=fabric.device)
                for i, (micro_inputs, micro_targets) in enumerate(
                    zip(inputs.chunk(k), targets.chunk(k))
                ):
                    # Accumulation: only the last micro-batch's backward all-reduces. Pitfall: the
                    # forward must run inside the context too, or DDP prepares a sync anyway
                    with fabric.no_backward_sync(model, enabled=i < k - 1):
                        loss = loss_fn(model(micro_inputs), micro_targets)
                        fabric.backward(loss / k)  # mean of k equal micro-batches: the batch's
                    local_loss += loss.detach() / k
                if cfg.gradient_clip_val:  # the norm of the averaged (global) gradient
                    fabric.clip_gradients(model, optimizer, max_norm=cfg.gradient_clip_val)
                optimizer.step()  # every rank applies the same averaged gradient
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
                losses.append(float(fabric.all_reduce(local_loss, reduce_op="mean")))
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
                if cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0:
                    # Every rank calls save; under DDP Fabric writes one full, unwrapped state
                    # from rank 0 (no "module." prefix) and waits for it
                    fabric.save(
                        os.path.join(cfg.checkpoint_dir, f"step-{step}.ckpt"),
                        {"model": model, "optimizer": optimizer, "step": step},
                    )
        # --8<-- [end:loop]
        return losses
    finally:
        # Pitfall: the DDP reducer inside Fabric's model holds the process group: freed after
        # the group (at exit, say), it can hang gloo's teardown. Let the model go first.
        model = optimizer = None
        cleanup_distributed()


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(FabricConfig, prog="python -m recipes.lightning_fabric", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), FabricConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
