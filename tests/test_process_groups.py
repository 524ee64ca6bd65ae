"""process_groups: a DeviceMesh's dimensions are the row and column groups new_group builds by
hand."""

import dataclasses

import pytest
import torch

from recipes import process_groups
from recipes.core.world import join_world
from recipes.parallelize import rank_grid
from tests.helpers import BACKENDS, last_json, require_world, run_cli, spawn_world


def groups_world(configs, backend):
    with join_world(backend, timeout_s=120):
        return [process_groups.run(cfg) for cfg in configs]


def expected_groups(dp: int, tp: int) -> list[dict]:
    """Per rank of a row-major dp x tp grid: its row (tp group), its column (dp group), and their
    sums."""
    groups = []
    for rank in range(dp * tp):
        d, t = divmod(rank, tp)
        row, column = [d * tp + i for i in range(tp)], [i * tp + t for i in range(dp)]
        groups.append(
            {
                "tp": {
                    "ranks": row,
                    "all_reduce_sum": float(sum(r + 1 for r in row)),
                    "coordinate": t,
                },
                "dp": {
                    "ranks": column,
                    "all_reduce_sum": float(sum(r + 1 for r in column)),
                    "coordinate": d,
                },
            }
        )
    return groups


@pytest.mark.parametrize("backend", BACKENDS)
def test_mesh_groups_equal_the_groups_built_by_hand(backend):
    require_world(backend, 4)
    # 2 x 2, and the two degenerate shapes: one group of everybody, and groups of one.
    configs = [process_groups.GroupsConfig(tp=tp, backend=backend) for tp in (2, 4, 1)]
    results = spawn_world(groups_world, 4, configs, backend, deadline_s=180)
    for cfg, result in zip(configs, results):
        dp = 4 // cfg.tp
        report = dataclasses.asdict(result)  # the GroupsReport run returns
        assert report["mesh_shape"] == [dp, cfg.tp]
        assert report["rank_grid"] == torch.arange(4).reshape(dp, cfg.tp).tolist()
        # Every rank's mesh["tp"] / mesh["dp"] group holds the ranks of its hand-built row / column,
        # and an all-reduce over either sums rank+1 over exactly those ranks (the recipe raises on
        # any mismatch).
        assert report["groups_per_rank"] == expected_groups(dp, cfg.tp)
        assert report["tp_groups"] == [[d * cfg.tp + t for t in range(cfg.tp)] for d in range(dp)]
        assert report["dp_groups"] == [[d * cfg.tp + t for d in range(dp)] for t in range(cfg.tp)]


def test_the_rank_grid_of_a_3d_mesh_has_one_table_per_outer_coordinate():
    class Mesh:  # rank_grid reads only these three attributes of a DeviceMesh
        mesh, ndim, mesh_dim_names = torch.arange(8).reshape(2, 2, 2), 3, ("pp", "dp", "tp")

    assert rank_grid(Mesh()).splitlines() == [
        "mesh pp x dp x tp = 2 x 2 x 2",
        "pp=0:",
        "          tp=0  tp=1",
        "  dp=0       0     1",
        "  dp=1       2     3",
        "pp=1:",
        "          tp=0  tp=1",
        "  dp=0       4     5",
        "  dp=1       6     7",
    ]


def test_tp_that_does_not_divide_the_world_is_rejected():
    with pytest.raises(
        ValueError, match=r"tp=3 does not divide the world size 4; use --tp 1, 2, 4"
    ):
        process_groups.mesh_shape(4, 3)


# Slow: a torchrun launch (torchrun and its workers each import torch: ~10 s of CPU).
# The same code runs in a spawned world in the default run; test_ddp_torchrun, test_elastic
# and test_multinode cover the launch path itself there.
@pytest.mark.slow
def test_torchrun_launch_prints_the_rank_map():
    launched = run_cli(
        ["torchrun", "--standalone", "--nproc_per_node=2", "-m", "recipes.process_groups"],
        timeout_s=120,
    )
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert (
        "mesh dp x tp = 1 x 2" in launched.stdout and "tp groups (rows): [0, 1]" in launched.stdout
    )
    result = last_json(launched.stdout)
    assert result["groups_per_rank"] == expected_groups(1, 2)
    assert "[rank1]" not in launched.stdout
