"""Fault-tolerant DDP with torchft: when a replica group dies, the others keep training.

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000      # the coordinator, once
    torchrun --standalone --nproc_per_node=1 -m recipes.fault_tolerance --replica-id 0
    torchrun --standalone --nproc_per_node=1 -m recipes.fault_tolerance --replica-id 1
    python -m recipes.fault_tolerance --replica-id 1     # a group of one rank needs no torchrun

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the group's own world), recipes/options.py (the command line, from the config). Needs
``pip install torchft``.

Each replica group is its own torchrun world (its own ``--standalone`` rendezvous, restarted on
its own). torchft joins the groups: every step, each group's Manager asks the lighthouse for a
quorum (the groups alive now), the gradient is averaged across the quorum's groups, and the
optimizer steps only if every group in the quorum says the step went well (``should_commit``).
A group that dies mid-step makes the survivors' step fail: they do not commit it (the optimizer
does not step, the step count stays), the next quorum leaves the dead group out, and the
survivors go on alone. A group that starts late (or restarts) finds itself behind the quorum's
step and heals: it receives the weights, the optimizer state and the step from a live peer
before it takes part. No checkpoint on disk is read, and no survivor restarts.

Data: the global batch is split over ``replica_groups`` x ranks-per-group fixed shares (torchft's
``DistributedSampler``). While a group is down nobody reads its share: the survivors keep their
shares, the gradient is their average, so the global batch shrinks for those steps. The batch of
step s is picked by the committed step, so a retried or healed step reads the same batch.

With no failure, 2 groups of 1 rank equal DDP over 2 ranks on the same global batch
(tests/test_fault_tolerance.py). Ranks inside a group average their gradients over the group's
own world after torchft averaged each rank's across the groups. HSDP inside a group (torchft's
``ft_init_device_mesh`` with fully_shard) is left out: this file is the DDP case.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset

try:
    import torchft
except ImportError:  # refused in one line by train(), not at import
    torchft = None


@dataclass
class FaultTolerantConfig:
    replica_id: int = option(0, "this replica group's number, 0 .. replica_groups-1", at_least=0)
    replica_groups: int = option(2, "how many replica groups share the global batch", at_least=1)
    lighthouse: str = option("http://localhost:29510", "the torchft lighthouse's address")
    min_replica_size: int = option(1, "fewest groups a step may commit with", at_least=1)
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(8, "committed optimizer steps", at_least=1)
    global_batch_size: int = option(12, "sequences per step, summed over all groups", at_least=1)
    lr: float = option(1e-3, "the optimizer's learning rate", above=0)
    optimizer: str = option("adamw", "the optimizer torchft wraps", choices=["adamw", "sgd"])
    seed: int = option(0, "model init and data order, the same in every group", at_least=0)
    timeout_s: float = option(30.0, "seconds a collective, commit vote or healing waits", above=0)
    quorum_timeout_s: float = option(30.0, "seconds a step waits for its quorum", above=0)
    connect_timeout_s: float = option(10.0, "seconds to reach the lighthouse and peers", above=0)
    save_path: str | None = option(None, "rank 0 saves the weights and optimizer state here")

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.replica_id >= self.replica_groups:
            raise ValueError(
                f"replica_id={self.replica_id} is not below replica_groups="
                f"{self.replica_groups}; number the groups 0 .. {self.replica_groups - 1}"
            )
        if self.min_replica_size > self.replica_groups:
            raise ValueError(
                f"min_replica_size={self.min_replica_size} is more than replica_groups="
                f"{self.replica_groups}: no step could commit"
            )
        if not self.lighthouse.startswith(("http://", "https://")):
            raise ValueError(
                f"lighthouse {self.lighthouse!r} must be a URL, e.g. http://host:29510"
            )


# --8<-- [start:train]
def train(cfg: FaultTolerantConfig, observer=None) -> list[float]:
    """Train this replica group's rank; returns each committed step's loss, averaged over the
    quorum's groups."""
    if torchft is None:
        raise ValueError("fault_tolerance needs torchft: pip install torchft")
    world = setup_distributed("gloo", timeout_s=cfg.timeout_s)  # this group's own world
    store = manager = None
    try:
        device, rank, group_size = world.device, world.rank, world.world_size
        use_cuda = device.type == "cuda"
        shares = cfg.replica_groups * group_size
        if cfg.global_batch_size % shares:
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide into {shares} shares "
                f"({cfg.replica_groups} groups x {group_size} ranks); use a multiple of {shares}"
            )
        per_rank_batch = cfg.global_batch_size // shares
        if "MASTER_ADDR" in os.environ:  # torchrun's store: the Manager finds it in the env
            store_addr, store_port = None, None
        else:  # a group of one without torchrun: a store of its own for the Manager
            store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", store.port

        # --8<-- [start:loop]
        # Pitfall: the same seed in every group: init_sync=False below trusts that the groups
        # start equal (a group that starts late still heals from a peer)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        if cfg.optimizer == "sgd":
            inner = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

        def load_state_dict(state):  # called when this group heals from a live peer
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optimizer"])
            if rank == 0:
                print(f"healed from a live peer at step {manager.current_step()}", flush=True)

        try:
            manager = torchft.Manager(
                pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=cfg.timeout_s)),
                load_state_dict=load_state_dict,
                state_dict=lambda: {"model": model.state_dict(), "optimizer": inner.state_dict()},
                min_replica_size=cfg.min_replica_size,  # fewer groups alive: no step commits
                replica_id=f"group{cfg.replica_id}",
                lighthouse_addr=cfg.lighthouse,  # rank 0's ManagerServer connects to it now
                rank=rank,  # within this group
                world_size=group_size,
                store_addr=store_addr,
                store_port=store_port,
                init_sync=False,
                timeout=timedelta(seconds=cfg.timeout_s),
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
            )
        except RuntimeError as exc:
            if "failed to connect" not in str(exc):
                raise
            raise ValueError(
                f"no torchft lighthouse at {cfg.lighthouse} within {cfg.connect_timeout_s:g} s: "
                "start one (torchft_lighthouse --min_replicas 1) or fix --lighthouse"
            ) from None
        optimizer = torchft.Optimizer(manager, inner)  # zero_grad: quorum; step: commit or not
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # a fixed share per (group, rank): rank + group_size * replica_id of replica_groups x
        # group_size shares; the share of a group that is down is not read while it is down
        sampler = torchft.DistributedSampler(
            dataset,
            replica_rank=cfg.replica_id,
            num_replica_groups=cfg.replica_groups,
            group_rank=rank,
            num_replicas=group_size,
            shuffle=True,
            seed=cfg.seed,
            drop_last=True,
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
        )

        losses, epoch, batches, quorum_size = [], -1, [], 0
        while (step := manager.current_step()) < cfg.steps:
            # the committed step picks the batch: a failed step is retried on the same batch,
            # and a healed group reads what the others read
            if step // len(loader) != epoch:
                epoch = step // len(loader)
                # Pitfall: without set_epoch every epoch repeats the first epoch's order
                sampler.set_epoch(epoch)
                batches = list(loader)
            inputs, targets = batches[step % len(batches)]
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            # torchft: zero_grad also asks for this step's quorum, in the background
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            # DDP's all-reduce, by the Manager: the gradients and the loss in one flat buffer,
            # averaged over the quorum's groups. A peer that fails makes it error, not raise:
            # the Manager remembers, and this step will not commit.
            grads = [p.grad for p in model.parameters()]
            # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
            flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
            manager.allreduce(flat).wait()
            if group_size > 1:  # then the group's own ranks average theirs
                dist.all_reduce(flat, op=dist.ReduceOp.AVG)
            for g, averaged in zip(grads, flat.split([g.numel() for g in grads] + [1])):
                g.copy_(averaged.view_as(g))
            # torchft: the step is taken only if every group in the quorum voted it good
            optimizer.step()  # every rank applies the same averaged gradient
            if manager.num_participants() != quorum_size and rank == 0:
                print(f"quorum changed: {manager.num_participants()} replica groups", flush=True)
            quorum_size = manager.num_participants()
            if manager.current_step() == step:  # not committed: a peer failed mid-step
                if rank == 0:
                    why = str(manager.errored()).splitlines()[0]
                    print(f"step {step} not committed: {why}", flush=True)
                continue
            step = manager.current_step() - 1  # a group that healed in this step jumped ahead
            losses.append(flat[-1].item())  # the quorum's mean loss
            if rank == 0:
                print(f"step {step} loss {losses[-1]:.4f} quorum {quorum_size}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
        # --8<-- [end:loop]

        if cfg.save_path and rank == 0:  # each group its own file: the groups are equal
            torch.save(
                {"model": model.state_dict(), "optimizer": inner.state_dict()}, cfg.save_path
            )
        return losses
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
        cleanup_distributed()
        del store


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(FaultTolerantConfig, prog="python -m recipes.fault_tolerance", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), FaultTolerantConfig, argv)
    with exit_on_bad_input():  # torchft missing, a batch that does not divide: one line, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
