"""recipes/dist_setup.py: the set-up a copied recipe calls joins the world its launcher describes,
alone as a world of 1, reuses a group its caller made, and destroys only what it created.
(Slurm's variables: tests/test_slurm.py; a restarted torchrun attempt: tests/test_job.py.)"""

import pytest
import torch.distributed as dist

from recipes import dist_setup
from tests.helpers import spawn_world


def test_alone_it_is_a_world_of_one_and_cleanup_destroys_it(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID"):
        monkeypatch.setenv(key, "")  # restored after the test
        monkeypatch.delenv(key)
    info = dist_setup.setup_distributed("gloo")
    try:
        assert (info.rank, info.world_size, info.backend, info.device.type) == (0, 1, "gloo", "cpu")
        assert info.is_main and dist.is_initialized()
    finally:
        dist_setup.cleanup_distributed()
    assert not dist.is_initialized()
    # the group is held past destroy_process_group (a DDP reducer must not be its last holder)
    # and let go at exit, after a collection has freed the models
    assert dist_setup._ENDED_GROUPS
    dist_setup._free_ended_groups()
    assert not dist_setup._ENDED_GROUPS


def test_an_unknown_backend_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("RANK", "")
    monkeypatch.delenv("RANK")
    with pytest.raises(ValueError, match=r"^backend 'mpi': use 'auto', 'gloo' or 'nccl'$"):
        dist_setup.setup_distributed("mpi")


def _two_ranks() -> tuple:
    import torch

    info = dist_setup.setup_distributed("gloo", timeout_s=60)
    try:
        tensor = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(tensor)  # 1 + 2 on every rank
        joined = (info.rank, info.world_size, float(tensor))
    finally:
        dist_setup.cleanup_distributed()
    return joined, not dist.is_initialized()


def test_under_a_launcher_every_rank_joins_and_a_collective_sums():
    # spawn_world sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does
    assert spawn_world(_two_ranks, 2, deadline_s=60) == ((0, 2, 3.0), True)


def test_a_group_its_caller_made_is_used_as_it_is_and_left_to_the_caller(monkeypatch):
    """In one process (the branch does not depend on the world's size). It was the second half of
    the 2-rank test: a second gloo group built in the same two processes right after the first was
    destroyed failed now and then under a loaded suite ("connectFullMesh failed ... Connection
    closed by peer"), a gloo matter, not this function's."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reused = dist_setup.setup_distributed("gloo")
        dist_setup.cleanup_distributed()
        assert (reused.rank, reused.world_size) == (0, 1) and dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_resolve_precision_picks_for_the_device_and_refuses_what_it_lacks():
    """The one copy the sharded recipes share (fsdp, fsdp2, hybrid_parallel, sharded_accumulation,
    finetune): auto is fp32 on CPU; tf32 is a CUDA matmul mode, refused on CPU in one line."""
    import torch

    cpu = torch.device("cpu")
    assert dist_setup.resolve_precision("auto", cpu) == "fp32"
    assert dist_setup.resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(ValueError, match=r"^precision tf32 is a CUDA matmul mode .* on cpu; use"):
        dist_setup.resolve_precision("tf32", cpu)
