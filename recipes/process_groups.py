"""DeviceMesh dimensions are process groups: the subgroups new_group would build by hand, with a
rank map.

    torchrun --standalone --nproc_per_node=4 -m recipes.process_groups          # 2 x 2 (dp x tp)
    torchrun --standalone --nproc_per_node=8 -m recipes.process_groups --tp 4  # 2 x 4
    python -m recipes.process_groups                                           # 1 x 1

``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`` lays the ranks out row-major in
a dp x tp grid. Each named dimension is a family of process groups: ``mesh["tp"].get_group()`` is
this rank's ROW (the ranks that differ only in their tp coordinate), ``mesh["dp"].get_group()`` its
COLUMN. The last dimension varies fastest, so put the most talkative parallelism (tensor parallel)
last: its ranks are then consecutive, i.e. on the same node.

The recipe builds the same groups by hand with ``dist.new_group`` and checks, on every rank, that
they hold the same ranks and that an all-reduce over each gives the same sum. The rank map (the
grid, the rows and the columns) is logged on rank 0 and returned in the result's extras.

Pitfall (the reason meshes exist): ``new_group`` is a collective over the WHOLE world. Every rank
must create every group, in the same order, including the groups it is not a member of; a rank that
only creates "its" groups hangs the others (or pairs the wrong groups). ``init_device_mesh`` does
this for every dimension at once.

This is not a training recipe, so its config does not subclass TrainConfig (model, steps, lr...
would be options that do nothing); the result's ``losses`` are empty and ``seconds_per_step`` times
the all-reduces over both families of groups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from recipes.core.cli import run_cli
from recipes.core.config import Config, RecipeError, opt
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, peak_memory_bytes
from recipes.core.world import join_world

log = get_logger(__name__)


@dataclass
class GroupsConfig(Config):
    tp: int = opt(
        0, "size of the inner mesh dimension (tp); 0 = 2 when the world size is even, else 1", ge=0
    )
    backend: Literal["auto", "gloo", "nccl"] = opt(
        "auto",
        "process-group backend; auto = nccl with one GPU per local rank, else gloo (env "
        "RECIPES_BACKEND)",
    )
    timeout_s: float = opt(
        120.0, "collective timeout in seconds: a stuck rank errors out instead of hanging", gt=0
    )


def mesh_shape(world_size: int, tp: int = 0) -> tuple[int, int]:
    """(dp, tp) for ``world_size`` ranks, or a RecipeError naming the sizes that fit."""
    tp = tp or (2 if world_size % 2 == 0 else 1)
    if world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise RecipeError(
            f"tp={tp} does not divide the world size {world_size}; use --tp "
            f"{', '.join(map(str, divisors))}"
        )
    return world_size // tp, tp


# --8<-- [start:rank_grid]
def rank_grid(mesh: DeviceMesh) -> str:
    """The mesh as tables of global ranks: rows = second-to-last dim, columns = last dim (one table
    per coordinate of the dims before them, e.g. one per pipeline stage of a pp x dp x tp mesh)."""
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)])
    ranks = mesh.mesh if mesh.ndim >= 2 else mesh.mesh.reshape(1, -1)
    if mesh.ndim == 1:
        names.insert(0, "")
    width = max(len(f"{names[-1]}={ranks.shape[-1] - 1}"), len(str(int(ranks.max())))) + 2
    lines = [f"mesh {' x '.join(n for n in names if n)} = {' x '.join(map(str, mesh.mesh.shape))}"]
    for outer in itertools.product(*(range(n) for n in ranks.shape[:-2])):
        if outer:
            lines.append(", ".join(f"{name}={i}" for name, i in zip(names, outer)) + ":")
        lines.append(
            " " * 8 + "".join(f"{names[-1]}={c}".rjust(width) for c in range(ranks.shape[-1]))
        )
        for r, row in enumerate(ranks[outer]):
            label = f"{names[-2]}={r}" if names[-2] else ""
            lines.append(f"  {label:<6}" + "".join(str(int(rank)).rjust(width) for rank in row))
    return "\n".join(lines)
# --8<-- [end:rank_grid]


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
def run(cfg: GroupsConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        dp, tp = mesh_shape(world.world_size, cfg.tp)
        mesh = init_device_mesh(world.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        tp_groups, dp_groups = groups_by_hand(dp, tp)
        log.info(
            "%s\ntp groups (rows): %s\ndp groups (columns): %s",
            rank_grid(mesh),
            " ".join(map(str, map(list, tp_groups))),
            " ".join(map(str, map(list, dp_groups))),
        )

        timer, mine = StepTimer(world.device), {}
        for dim, by_hand in (("tp", tp_groups), ("dp", dp_groups)):
            mesh_group = mesh[dim].get_group()  # this rank's group along that dimension
            mesh_ranks = dist.get_process_group_ranks(mesh_group)
            hand_ranks = next(ranks for ranks in by_hand if world.rank in ranks)
            if tuple(mesh_ranks) != hand_ranks:
                raise RuntimeError(
                    f"rank {world.rank}: mesh['{dim}'] holds {mesh_ranks}, new_group "
                    f"{list(hand_ranks)}"
                )
            # The same collective over both groups: each sums rank+1 over the group's members.
            with timer:
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
        return RecipeResult(
            recipe="process_groups",
            world_size=world.world_size,
            backend=world.backend,
            device=str(world.device),
            losses=[],
            param_checksum=0.0,
            seconds_per_step=timer.seconds_per_step,
            peak_memory_bytes=peak_memory_bytes(world.device),
            extras={
                "mesh_shape": [dp, tp],
                "mesh_dim_names": ["dp", "tp"],
                "rank_grid": mesh.mesh.tolist(),
                "tp_groups": [list(r) for r in tp_groups],
                "dp_groups": [list(r) for r in dp_groups],
                "groups_per_rank": everyone,
            },
        )
# --8<-- [end:compare]


if __name__ == "__main__":
    run_cli(run, GroupsConfig, __doc__)
