"""LocalSGD and DiLoCo: each rank trains alone for H steps, then the replicas meet once.

    torchrun --standalone --nproc_per_node=2 -m recipes.local_sgd                 # LocalSGD, H=4
    torchrun --standalone --nproc_per_node=2 -m recipes.local_sgd --outer diloco --sync-every 8
    torchrun --standalone --nproc_per_node=2 -m recipes.local_sgd --torch-averager  # torch's own

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

DDP all-reduces every gradient on every step. Here no gradient leaves its rank: each replica steps
its own optimizer on its own share of the batch for ``sync_every`` (H) steps, then the replicas
synchronise once, with one all-reduce that carries every parameter and the window's losses. That
is H times fewer all-reduces (tests/test_local_sgd.py counts them), at the price of replicas that
drift apart between synchronisations.

- ``--outer average`` (LocalSGD): the replicas' weights are averaged.
- ``--outer diloco`` (DiLoCo, Douillard et al. 2023): the average of the replicas' moves since the
  last synchronisation (the pseudo-gradient) is handed to an outer optimizer, SGD with Nesterov
  momentum, which steps the shared weights. With H=1, plain SGD inside and an outer SGD at lr 1
  without momentum, both are DDP with SGD, step for step (asserted).
- ``--torch-averager``: the same LocalSGD with torch's own ``PostLocalSGDOptimizer`` and
  ``PeriodicModelAverager`` instead of the hand-written synchronisation (asserted equal).

Every rank starts from the same weights (the same seed) and ends on a synchronisation, so every
replica holds the same weights at the end (``steps`` must be a multiple of H). Streaming DiLoCo
(fragments synchronised at staggered steps) and replica groups that are themselves sharded (HSDP
inside, DiLoCo across) are left out: this file is the single-level algorithm.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class LocalSGDConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(8, "optimizer steps of each replica", at_least=1)
    global_batch_size: int = option(12, "sequences per step, summed over all ranks", at_least=1)
    lr: float = option(1e-3, "the inner optimizer's learning rate", above=0)
    inner_optimizer: str = option(
        "adamw", "what each replica steps with between synchronisations", choices=["adamw", "sgd"]
    )
    sync_every: int = option(4, "H: local steps between two synchronisations", at_least=1)
    outer: str = option(
        "average", "average: LocalSGD; diloco: outer Nesterov SGD", choices=["average", "diloco"]
    )
    outer_lr: float = option(0.7, "DiLoCo's outer learning rate", above=0)
    outer_momentum: float = option(0.9, "DiLoCo's outer Nesterov momentum", at_least=0)
    torch_averager: bool = option(
        False, "LocalSGD through torch's PostLocalSGDOptimizer instead of the loop's own sync"
    )
    seed: int = option(0, "model init and data order, the same on every rank", at_least=0)
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.steps % self.sync_every:
            lower = max(self.sync_every, self.steps - self.steps % self.sync_every)
            raise ValueError(
                f"steps={self.steps} is not a multiple of sync_every={self.sync_every}: training "
                f"must end on a synchronisation; use steps={lower}"
            )
        if self.outer_momentum >= 1:
            raise ValueError(f"outer_momentum={self.outer_momentum} must be below 1, e.g. 0.9")
        if self.torch_averager and self.outer != "average":
            raise ValueError(
                "torch_averager is LocalSGD's plain average; use outer='average' with it (DiLoCo's "
                "outer optimizer is written out in this file)"
            )


# --8<-- [start:sync]
def synchronise(model, window_losses, outer_weights=None, outer_optimizer=None) -> list[float]:
    """The replicas meet: ONE all-reduce carries every parameter (LocalSGD) or every pseudo-gradient
    (DiLoCo), and the losses of the window's steps. Returns those steps' losses, averaged over the
    replicas (each replica's loss on its own share, with its own weights)."""
    params = list(model.parameters())
    if outer_optimizer is None:  # LocalSGD: the weights themselves
        payload = [p.detach() for p in params]
    else:  # DiLoCo: how far this replica moved since the last synchronisation
        payload = [w - p.detach() for w, p in zip(outer_weights, params)]
    # One flat buffer, one collective (a bucket; a model too large for one copy would send a few)
    flat = torch.cat([t.reshape(-1).float() for t in payload] + [torch.stack(window_losses)])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    averaged = torch.split(flat, [t.numel() for t in payload] + [len(window_losses)])
    with torch.no_grad():
        if outer_optimizer is None:
            for p, mean in zip(params, averaged):
                p.copy_(mean.view_as(p))
        else:
            # the averaged move is the outer optimizer's gradient; it steps the shared weights,
            # and every replica restarts from them
            for w, mean in zip(outer_weights, averaged):
                w.grad = mean.view_as(w).to(w.dtype)
            outer_optimizer.step()
            outer_optimizer.zero_grad(set_to_none=True)
            for p, w in zip(params, outer_weights):
                p.copy_(w)
    return averaged[-1].tolist()


# --8<-- [end:sync]


# --8<-- [start:train]
def train(cfg: LocalSGDConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns each step's loss averaged over the replicas."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        if cfg.global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}"
            )
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank: with no DDP to broadcast rank 0's weights, the
        # replicas must start equal by construction
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        if cfg.inner_optimizer == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        outer_weights = outer_optimizer = None
        if cfg.torch_averager:
            # torch's LocalSGD: step() runs the inner step, then averages every sync_every calls.
            # It counts from its first call and averages when (calls - warmup) % period == 0:
            # warmup_steps = H - 1 averages after steps H-1, 2H-1, ..., as the loop below does.
            averager = PeriodicModelAverager(period=cfg.sync_every, warmup_steps=cfg.sync_every - 1)
            optimizer = PostLocalSGDOptimizer(optimizer, averager)
        elif cfg.outer == "diloco":
            # the shared weights live in the outer optimizer, apart from the replica's own
            outer_weights = [p.detach().clone() for p in model.parameters()]
            outer_optimizer = torch.optim.SGD(
                outer_weights,
                lr=cfg.outer_lr,
                momentum=cfg.outer_momentum,
                nesterov=cfg.outer_momentum > 0,  # torch: Nesterov needs a momentum
            )
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # as DDP's: each rank a disjoint share of every global batch
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset, batch_size=cfg.global_batch_size // world_size, sampler=sampler, drop_last=True
        )

        losses, window, step, epoch = [], [], 0, 0
        while step < cfg.steps:
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs, targets = inputs.to(device), targets.to(device)
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = lm_loss(model(inputs), targets)
                loss.backward()  # no all-reduce: the gradient stays on its replica
                optimizer.step()  # (with torch_averager, this also averages every H steps)
                window.append(loss.detach().float())
                if (step + 1) % cfg.sync_every == 0:
                    if cfg.torch_averager:  # weights averaged in step(): the losses still meet
                        mean = torch.stack(window)
                        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
                        synced = mean.tolist()
                    else:
                        synced = synchronise(model, window, outer_weights, outer_optimizer)
                    for offset, value in enumerate(synced):
                        done = step + 1 - len(synced) + offset
                        losses.append(value)
                        if rank == 0:
                            print(f"step {done} loss {value:.4f}", flush=True)
                        if observer:
                            observer.step_end(done, value)
                    window = []
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return losses
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(LocalSGDConfig, prog="python -m recipes.local_sgd", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), LocalSGDConfig, argv)
    with exit_on_bad_input():  # a batch that does not divide: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
