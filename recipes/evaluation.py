"""Validation loss across ranks that equals one process's: all-reduce sums and counts, no padded
repeats, no hang when ranks hold different numbers of batches.

    torchrun --standalone --nproc_per_node=2 -m recipes.evaluation
    torchrun --standalone --nproc_per_node=2 -m recipes.evaluation --sharded   # under fully_shard

Copy with it: recipes/data.py (the shards and ``TokenWindows``), recipes/toy.py,
recipes/dist_setup.py and recipes/options.py (the command line, from the config). ``torchmetrics``
is optional: ``evaluate_with_torchmetrics`` is the same sum with its ``MeanMetric``.

Three ways a distributed evaluation gives the wrong number, each shown by the result:

- a mean of per-rank means: with uneven shards a rank's mean weighs as much as a larger rank's;
- ``DistributedSampler`` (``drop_last=False``) pads the ranks to equal counts by REPEATING samples:
  those are counted twice;
- under fully_shard every forward is a collective: a rank that runs out of batches first leaves the
  others waiting in an all-gather, forever.

``evaluate`` adds the token losses and counts the tokens on each rank, over ``eval_shard`` (every
N-th window, no padding), all-reduces both once, and divides.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from recipes.data import DataConfig, TokenWindows, prepare_shards
from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import ModelConfig, build_model


@dataclass
class EvalConfig:
    data_dir: str = option(
        "data/shards", "token shards (prepared with recipes.data's defaults when absent)"
    )
    vocab_size: int = option(512, "BPE vocabulary when preparing", at_least=256, at_most=65536)
    seq_len: int = option(64, "tokens per window", at_least=1)
    batch_size: int = option(8, "windows per batch", at_least=1)
    # odd, so that 2 ranks hold uneven shards
    max_windows: int = option(301, "val windows evaluated", at_least=1)
    sharded: bool = option(False, "evaluate under fully_shard (lockstep loop)")
    # its import takes about 2 s: only when asked
    torchmetrics: bool = option(False, "also evaluate with torchmetrics' MeanMetric")
    seed: int = option(0, "model init seed", at_least=0)

    def __post_init__(self) -> None:
        check_options(self)  # the ranges above: one line each
        if Path(self.data_dir).exists() and not Path(self.data_dir).is_dir():
            raise ValueError(
                f"data_dir {self.data_dir} is a file; name the folder of the shards (index.json)"
            )


# --8<-- [start:evaluate]
def eval_shard(dataset: Dataset, rank: int, world_size: int) -> Subset:
    """Windows rank, rank + N, ...: every window on exactly one rank, none repeated (unlike
    DistributedSampler, which pads); the ranks' counts may differ by one."""
    return Subset(dataset, range(rank, len(dataset), world_size))


def any_rank_has(batch, device: torch.device) -> bool:
    flag = torch.tensor([0 if batch is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
def evaluate(model, loader, device: torch.device, *, lockstep: bool = False) -> float:
    """The mean token loss over every rank's batches: global sum / global count.

    ``lockstep=True`` (fully_shard, tensor parallel: forward is a collective): the ranks step
    together until the last one is done; a rank out of batches repeats a forward that counts zero.
    Plain DDP evaluates ``model.module``: no collective per batch, nothing to wait for.
    """
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    if lockstep:  # a rank with no batch at all has nothing to repeat: refuse on every rank
        flag = torch.tensor([min(len(loader), 1)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            raise ValueError("a rank holds no evaluation batch: use fewer ranks or more windows")
    batches, last = iter(loader), None
    while True:
        batch = next(batches, None)
        if lockstep and not any_rank_has(batch, device):
            break
        if batch is None and not lockstep:
            break
        counted = batch is not None
        batch = batch if counted else last  # a forward the others' all-gathers need
        inputs, targets = (t.to(device) for t in batch)
        out = model(inputs)  # a Hugging Face model returns an output that holds .logits
        logits = getattr(out, "logits", out).float()
        if counted:  # reduction="sum": a sum over tokens, never a mean of batch means
            loss_sum += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            tokens += targets.numel()
        last = batch
    totals = torch.stack([loss_sum, tokens])
    dist.all_reduce(totals)  # one collective, after each rank's own (uneven) loop
    model.train()
    return (totals[0] / totals[1]).item()


# --8<-- [end:evaluate]


# --8<-- [start:naive]
@torch.no_grad()
def evaluate_naively(
    model, dataset: Dataset, rank: int, world_size: int, batch_size: int, device: torch.device
) -> float:
    """WRONG, for comparison: DistributedSampler's padded repeats, a mean of batch means, then a
    mean of the ranks' means."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    means = [
        F.cross_entropy(model(x.to(device)).float().flatten(0, 1), y.to(device).flatten())
        for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    ]
    rank_mean = torch.stack(means).mean().double()
    dist.all_reduce(rank_mean)
    return (rank_mean / world_size).item()


# --8<-- [end:naive]


# --8<-- [start:torchmetrics]
@torch.no_grad()
def evaluate_with_torchmetrics(model, loader, device: torch.device) -> float:
    """``evaluate`` with torchmetrics: a MeanMetric weighted by tokens syncs its sum and weight
    across ranks in ``compute()`` (one collective, so uneven batch counts are fine)."""
    from torchmetrics.aggregation import MeanMetric  # imported here: ~2 s, only when used

    metric = MeanMetric().to(device)
    for inputs, targets in loader:
        logits = model(inputs.to(device)).float()
        batch_mean = F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten())
        metric.update(batch_mean, weight=targets.numel())  # weight: a mean counts its tokens
    return metric.compute().item()


# --8<-- [end:torchmetrics]


def run(cfg: EvalConfig) -> dict:
    """The toy model's validation loss: right; and, on a replicated model, the naive way and
    (``cfg.torchmetrics``) torchmetrics' way."""
    world = setup_distributed()
    try:
        if world.rank == 0 and not (Path(cfg.data_dir) / "index.json").exists():
            prepare_shards(DataConfig(data_dir=cfg.data_dir, vocab_size=cfg.vocab_size))
        dist.barrier()
        index = json.loads((Path(cfg.data_dir) / "index.json").read_text())
        windows = TokenWindows(cfg.data_dir, "val", cfg.seq_len)
        if len(windows) < world.world_size:  # every rank reads the same index: all refuse
            raise ValueError(
                f"the val split holds {len(windows)} windows of seq_len={cfg.seq_len}; "
                f"{world.world_size} rank(s) need one each: lower seq_len, or use fewer ranks"
            )
        windows = Subset(windows, range(min(cfg.max_windows, len(windows))))
        model = build_model(
            ModelConfig(
                vocab_size=index["vocab_size"], seq_len=cfg.seq_len, dim=64, n_layers=2, n_heads=4
            ),
            seed=cfg.seed,
            device=world.device,
        )
        if cfg.sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # Pitfall: without a mesh fully_shard builds one on the accelerator torch finds: on a
            # GPU host whose ranks run gloo on CPU, that is a CUDA device a rank may not have.
            mesh = init_device_mesh(world.device.type, (world.world_size,))
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        loader = DataLoader(
            eval_shard(windows, world.rank, world.world_size), batch_size=cfg.batch_size
        )
        result = {
            "val_loss": evaluate(model, loader, world.device, lockstep=cfg.sharded),
            "windows": len(windows),
            "world_size": world.world_size,
            "windows_per_rank": [
                len(range(r, len(windows), world.world_size)) for r in range(world.world_size)
            ],
        }
        if not cfg.sharded:
            result["naive_val_loss"] = evaluate_naively(
                model, windows, world.rank, world.world_size, cfg.batch_size, world.device
            )
            result["naive_error"] = result["naive_val_loss"] - result["val_loss"]
        if cfg.torchmetrics:
            result["torchmetrics_val_loss"] = evaluate_with_torchmetrics(
                model, loader, world.device
            )
        return result
    finally:
        cleanup_distributed()


def make_parser() -> argparse.ArgumentParser:
    return config_parser(EvalConfig, prog="python -m recipes.evaluation", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), EvalConfig, argv)
    with exit_on_bad_input():  # a val split too short for the ranks: one line from rank 0
        result = run(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"config": asdict(cfg), **result}))


if __name__ == "__main__":
    main()
