"""Lightning Fabric: the raw DDP loop of recipes.ddp_torchrun, converted to Fabric line by line;
same losses.

    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_fabric
    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_fabric \\
        --accumulate-grad-batches 2 --checkpoint-every-n-steps 3
    python -m recipes.lightning_fabric                    # a world of 1: no torchrun needed

Copy with it: recipes/toy.py, recipes/dist_setup.py

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
    ddp_model = DDP(model, device_ids=[...])       (gone)
    optimizer = AdamW(ddp_model.parameters(), lr)  optimizer = AdamW(model.parameters(), lr)
    +                                              ddp_model, optimizer = fabric.setup(model,
                                                                                      optimizer)
    loader = DataLoader(..., sampler=sampler)      the same, then loader = fabric.setup_dataloaders(
                                                       loader, use_distributed_sampler=False)
    sampler.set_epoch(epoch)                       (gone: Fabric's loader calls it)
    inputs, targets = inputs.to(dev), ....to(dev)  (gone: the loader moves batches to the device)
    loss.backward()                                fabric.backward(loss)
    with ddp_model.no_sync(): (accumulation)       with fabric.no_backward_sync(ddp_model,
                                                                                enabled=...):
    dist.all_reduce(loss, op=ReduceOp.AVG)         fabric.all_reduce(loss, reduce_op="mean")
    if rank == 0: torch.save(model.state_dict(),   fabric.save(p, {"model": ddp_model,
                             p)                                    "optimizer": ..., "step": ...})
    model.load_state_dict(torch.load(p))           fabric.load(p, state)

In a script of your own, ``fabric.launch()`` also creates the process group (and, under plain python
with ``devices=N``, starts the N processes). Here ``setup_distributed`` creates it first, from
torchrun's variables (or Slurm's), and Fabric uses the group it finds: the same launch as every
other recipe.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
from dataclasses import dataclass

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset

PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed")


@dataclass
class FabricConfig:
    model: str = "tiny"  # a key of MODEL_PRESETS
    steps: int = 6
    global_batch_size: int = 12  # sequences per optimizer step, summed over all ranks
    lr: float = 1e-3
    seed: int = 0  # same seed -> same weights and data order on every rank, on any world size
    # Lightning's own precision names (plus auto): Lightning users know these
    precision: str = "auto"  # auto: bf16-mixed on a GPU, 32-true on CPU
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step
    gradient_clip_val: float = 0.0  # clip the global gradient norm to this (0: off)
    checkpoint_every_n_steps: int = 0  # fabric.save every N optimizer steps (0: never)
    checkpoint_dir: str = "checkpoints/lightning_fabric"  # step-N.ckpt files go here
    resume_from: str = ""  # a step-N.ckpt that fabric.save wrote: training goes on at its step
    backend: str = "auto"  # auto: nccl with a GPU for each local rank, else gloo
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        # what the command line checks, also for a config built in code: one line, not a
        # ZeroDivisionError or a KeyError deep inside train
        for name, low, above in (
            ("steps", 1, False),
            ("global_batch_size", 1, False),
            ("lr", 0, True),
            ("accumulate_grad_batches", 1, False),
            ("gradient_clip_val", 0, False),
            ("timeout_s", 0, True),
            ("checkpoint_every_n_steps", 0, False),
            ("seed", 0, False),
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < low or (above and value == low):
                raise ValueError(
                    f"{name} must be a finite number {'>' if above else '>='} {low}, got {value}"
                )
        for name, valid in (
            ("model", sorted(MODEL_PRESETS)),
            ("precision", PRECISIONS),
            ("backend", ("auto", "nccl", "gloo")),
        ):
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}; valid values: {', '.join(valid)}"
                )
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
        ddp_model, optimizer = fabric.setup(model, optimizer)  # DDP wrapper + precision, one call
        start_step = 0
        if cfg.resume_from:
            state = {"model": ddp_model, "optimizer": optimizer, "step": 0}
            try:  # restores model and optimizer in place, on every rank
                fabric.load(cfg.resume_from, state)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:  # a truncated file
                raise ValueError(
                    f"--resume-from {cfg.resume_from} cannot be read as a checkpoint"
                    f" ({str(exc).splitlines()[0]})"
                ) from None  # every rank alike
            start_step = state["step"]
        if observer:
            observer.model_ready(ddp_model, optimizer)

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
                    with fabric.no_backward_sync(ddp_model, enabled=i < k - 1):
                        loss = loss_fn(ddp_model(micro_inputs), micro_targets)
                        fabric.backward(loss / k)  # mean of k equal micro-batches: the batch's
                    local_loss += loss.detach() / k
                if cfg.gradient_clip_val:  # the norm of the averaged (global) gradient
                    fabric.clip_gradients(ddp_model, optimizer, max_norm=cfg.gradient_clip_val)
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
                        {"model": ddp_model, "optimizer": optimizer, "step": step},
                    )
        # --8<-- [end:loop]
        return losses
    finally:
        # Pitfall: DDP's reducer inside ddp_model holds the process group: freed after the group
        # (at exit, say), it can hang gloo's teardown. Let the model go first.
        ddp_model = optimizer = None
        cleanup_distributed()


# --8<-- [end:train]


def _number(kind, *, above=None, at_least=None):
    """An argparse type: a finite ``kind`` in range, else one line that says what is valid."""
    bound = f"> {above}" if above is not None else f">= {at_least}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not math.isfinite(value) or not (
            value > above if above is not None else value >= at_least
        ):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


def make_parser() -> argparse.ArgumentParser:
    defaults = FabricConfig()
    parser = argparse.ArgumentParser(
        prog="python -m recipes.lightning_fabric",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--model", choices=sorted(MODEL_PRESETS), default=defaults.model, help="model size")
    add("--steps", type=_number(int, at_least=1), default=defaults.steps, help="optimizer steps")
    add(
        "--global-batch-size",
        type=_number(int, at_least=1),
        default=defaults.global_batch_size,
        help="sequences per optimizer step, summed over all ranks",
    )
    add("--lr", type=_number(float, above=0), default=defaults.lr, help="AdamW's")
    add(
        "--seed",
        type=_number(int, at_least=0),
        default=defaults.seed,
        help="model init and data order; the same seed gives the same losses on any world size",
    )
    add(
        "--precision",
        choices=PRECISIONS,
        default=defaults.precision,
        help="Fabric precision; auto: bf16-mixed on a GPU, 32-true on CPU; 16-mixed needs CUDA",
    )
    add(
        "--accumulate-grad-batches",
        type=_number(int, at_least=1),
        default=defaults.accumulate_grad_batches,
        help="micro-batches per optimizer step (the global batch stays global_batch_size)",
    )
    add(
        "--gradient-clip-val",
        type=_number(float, at_least=0),
        default=defaults.gradient_clip_val,
        help="clip the global gradient norm to this value (fabric.clip_gradients); 0: off",
    )
    add(
        "--checkpoint-every-n-steps",
        type=_number(int, at_least=0),
        default=defaults.checkpoint_every_n_steps,
        help="fabric.save a checkpoint every N optimizer steps; 0: never",
    )
    add(
        "--checkpoint-dir",
        default=defaults.checkpoint_dir,
        help="where checkpoints go (step-N.ckpt)",
    )
    add(
        "--resume-from",
        default=defaults.resume_from,
        help="checkpoint to resume from (fabric.load): training goes on at its step",
    )
    add(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default=defaults.backend,
        help="process-group backend; auto: nccl with a GPU per local rank, else gloo",
    )
    add(
        "--timeout-s",
        type=_number(float, above=0),
        default=defaults.timeout_s,
        help="seconds a collective waits for its peers before failing",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = FabricConfig(**vars(make_parser().parse_args(argv)))
        train(cfg)
    except ValueError as exc:  # bad input every rank sees: one line, from rank 0
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
