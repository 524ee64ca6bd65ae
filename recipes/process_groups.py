"""DeviceMesh dimensions are process groups: the subgroups new_group would build by hand, with a
rank map.

    torchrun --standalone --nproc_per_node=4 -m recipes.process_groups          # 2 x 2 (dp x tp)
    torchrun --standalone --nproc_per_node=8 -m recipes.process_groups --tp 4  # 2 x 4
    python -m recipes.process_groups                                           # 1 x 1

Copy with it: recipes/dist_setup.py, recipes/parallelize.py (``rank_grid``, the rank map),
recipes/options.py (the command line, from the config).

``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`` lays the ranks out row-major in
a dp x tp grid. Each named dimension is a family of process groups: ``mesh["tp"].get_group()`` is
this rank's ROW (the ranks that differ only in their tp coordinate), ``mesh["dp"].get_group()`` its
COLUMN. The last dimension varies fastest, so put the most talkative parallelism (tensor parallel)
last: its ranks are then consecutive, i.e. on the same node.

The recipe builds the same groups by hand with ``dist.new_group`` and checks, on every rank, that
they hold the same ranks and that an all-reduce over each gives the same sum. Rank 0 prints the
rank map (the grid, the rows and the columns), then every rank's groups as one JSON line;
``run`` returns them (a ``GroupsReport``).

Pitfall (the reason meshes exist): ``new_group`` is a collective over the WHOLE world. Every rank
must create every group, in the same order, including the groups it is not a member of; a rank that
only creates "its" groups hangs the others (or pairs the wrong groups). ``init_device_mesh`` does
this for every dimension at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import rank_grid


@dataclass
class GroupsConfig:
    tp: int = option(
        0,
        "size of the inner mesh dimension (tp); 0 = 2 when the world size is even, else 1",
        at_least=0,
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    # a stuck rank errors out instead of hanging
    timeout_s: float = option(120.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each


@dataclass
class GroupsReport:
    """The layout, and what every rank found along each dimension (rank order)."""

    world_size: int
    backend: str
    mesh_shape: list[int]
    mesh_dim_names: list[str]
    rank_grid: list[list[int]]
    tp_groups: list[list[int]]  # the rows
    dp_groups: list[list[int]]  # the columns
    # per rank: {"tp": {"ranks", "all_reduce_sum", "coordinate"}, "dp": {...}}
    groups_per_rank: list[dict] = field(default_factory=list)


def mesh_shape(world_size: int, tp: int = 0) -> tuple[int, int]:
    """(dp, tp) for ``world_size`` ranks, or a ValueError naming the sizes that fit."""
    tp = tp or (2 if world_size % 2 == 0 else 1)
    if world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"tp={tp} does not divide the world size {world_size}; use --tp "
            f"{', '.join(map(str, divisors))}"
        )
    return world_size // tp, tp


# --8<-- [start:by_hand]
def groups_by_hand(
    dp: int, tp: int
) -> tuple[dict[tuple[int, ...], dist.ProcessGroup], dict[tuple[int, ...], dist.ProcessGroup]]:
    """The rows (tp groups) and columns (dp groups) of a row-major dp x tp grid, built with
    new_group.

    Every rank calls new_group for EVERY group, in the same order: new_group is a collective.
    """
    # same dp coordinate: a tp group
    rows = [tuple(d * tp + t for t in range(tp)) for d in range(dp)]
    # same tp coordinate: a dp group
    columns = [tuple(d * tp + t for d in range(dp)) for t in range(tp)]
    tp_groups = {ranks: dist.new_group(list(ranks)) for ranks in rows}
    dp_groups = {ranks: dist.new_group(list(ranks)) for ranks in columns}
    return tp_groups, dp_groups


# --8<-- [end:by_hand]


# --8<-- [start:compare]
def run(cfg: GroupsConfig) -> GroupsReport:
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        dp, tp = mesh_shape(world.world_size, cfg.tp)
        mesh = init_device_mesh(world.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        tp_groups, dp_groups = groups_by_hand(dp, tp)
        if world.is_main:
            print(
                f"{rank_grid(mesh)}\ntp groups (rows): {' '.join(map(str, map(list, tp_groups)))}"
                f"\ndp groups (columns): {' '.join(map(str, map(list, dp_groups)))}",
                flush=True,
            )

        mine = {}
        for dim, by_hand in (("tp", tp_groups), ("dp", dp_groups)):
            mesh_group = mesh[dim].get_group()  # this rank's group along that dimension
            mesh_ranks = dist.get_process_group_ranks(mesh_group)
            hand_ranks = next(ranks for ranks in by_hand if world.rank in ranks)
            if tuple(mesh_ranks) != hand_ranks:
                raise RuntimeError(
                    f"rank {world.rank}: mesh['{dim}'] holds {mesh_ranks}, "
                    f"new_group {list(hand_ranks)}"
                )
            # The same collective over both groups: each sums rank+1 over the group's members.
            sums = []
            for group in (mesh_group, by_hand[hand_ranks]):
                value = torch.tensor([world.rank + 1.0], device=world.device)
                dist.all_reduce(value, group=group)
                sums.append(value.item())
            if sums[0] != sums[1] or sums[0] != sum(r + 1 for r in hand_ranks):
                raise RuntimeError(
                    f"rank {world.rank}: all_reduce over the {dim} groups gave {sums}"
                )
            mine[dim] = {
                "ranks": list(mesh_ranks),
                "all_reduce_sum": sums[0],
                "coordinate": mesh[dim].get_local_rank(),
            }

        everyone: list[dict | None] = [None] * world.world_size
        dist.all_gather_object(everyone, mine)  # rank 0 reports every rank's groups
        return GroupsReport(
            world_size=world.world_size,
            backend=world.backend,
            mesh_shape=[dp, tp],
            mesh_dim_names=["dp", "tp"],
            rank_grid=mesh.mesh.tolist(),
            tp_groups=[list(r) for r in tp_groups],
            dp_groups=[list(r) for r in dp_groups],
            groups_per_rank=everyone,
        )
    finally:
        cleanup_distributed()


# --8<-- [end:compare]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(GroupsConfig, prog="python -m recipes.process_groups", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), GroupsConfig, argv)
    with exit_on_bad_input():  # a tp that does not divide the world: one line from rank 0, exit 2
        report = run(cfg)
    if int(os.environ.get("RANK", 0)) == 0:  # the report as the last line, for scripts
        print(json.dumps({"recipe": "process_groups", **dataclasses.asdict(report)}), flush=True)


if __name__ == "__main__":
    main()
