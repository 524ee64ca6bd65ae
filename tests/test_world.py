"""The world harness: one way in (setup_distributed, as a with-block), the one guard around a
recipe's own process-group calls, and failures that become clear errors, never hangs."""

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from recipes.core.errors import RecipeError
from recipes.core.world import RankError, WorldTimeoutError, join_world, recipe_world
from tests.deadlines import scaled
from tests.helpers import PYTHON, run_cli, spawn_world


# Module-level functions: spawned ranks import them by name.
def describe_world():
    with join_world("gloo", timeout_s=30) as world:
        ranks = [None] * world.world_size
        dist.all_gather_object(ranks, (world.rank, world.local_rank))
        return world.world_size, world.backend, str(world.device), ranks


def raise_on_rank(bad_rank):
    with join_world("gloo", timeout_s=30) as world:
        if world.rank == bad_rank:
            raise ZeroDivisionError("bad arithmetic on purpose")
        dist.barrier()


def refuse_a_model_on_rank(bad_rank):
    from recipes.parallelize import apply_fully_shard

    with join_world("gloo", timeout_s=30) as world:
        if world.rank == bad_rank:
            apply_fully_shard(torch.nn.Linear(2, 2), None, block_types=(torch.nn.Conv2d,))
        dist.barrier()


def skip_a_collective(timeout_s):
    # Joining may be slow on a loaded machine, so only the group under test gets the short timeout.
    with join_world("gloo", timeout_s=120) as world:
        short = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
        if world.rank == 0:
            dist.all_reduce(torch.ones(1), group=short)  # rank 1 never joins this all_reduce
        else:
            time.sleep(60)


def wait_forever_in_barrier():
    with join_world("gloo", timeout_s=600) as world:  # collectives would wait 10 minutes...
        dist.barrier()  # both ranks are up: from here on, only the deadline can end this world
        if world.rank == 0:
            dist.barrier()
        else:
            time.sleep(600)


def die_mid_run():
    with join_world("gloo", timeout_s=30) as world:
        for step in range(3):
            if step == 1 and world.rank == 1:
                os._exit(3)  # no exception, no cleanup: like an OOM kill
            dist.all_reduce(torch.ones(1))


def test_spawned_world_sees_the_torchrun_variables():
    world_size, backend, device, ranks = spawn_world(describe_world, 3, deadline_s=60)
    assert (world_size, backend, device) == (3, "gloo", "cpu")
    assert ranks == [(0, 0), (1, 1), (2, 2)]


def test_a_single_process_is_a_world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    world_size, backend, device, ranks = describe_world()
    assert (world_size, backend, device, ranks) == (1, "gloo", "cpu", [(0, 0)])
    assert not dist.is_initialized(), "the process group must be destroyed on the way out"


def test_process_group_is_destroyed_when_the_body_raises():
    with pytest.raises(KeyError):
        with join_world("gloo"):
            raise KeyError("boom")
    assert not dist.is_initialized()


def test_the_guard_rebinds_the_process_group_calls_for_the_recipes_call_only():
    """prove runs a recipe inside recipe_world, the one rebinding of init/destroy_process_group:
    in a caller's world both do nothing (the recipe trains in it); alone, the recipe joins and
    leaves itself. Either way torch's own functions are back afterwards."""
    init, destroy = dist.init_process_group, dist.destroy_process_group
    with join_world("gloo"):
        with recipe_world():
            dist.init_process_group("gloo")  # would refuse: the default group exists
            dist.destroy_process_group()
        assert dist.is_initialized(), "the caller's world outlives the recipe"
    assert not dist.is_initialized()
    with recipe_world():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.is_initialized()
        dist.destroy_process_group()
    assert not dist.is_initialized()
    assert (dist.init_process_group, dist.destroy_process_group) == (init, destroy)


def test_failing_rank_is_reraised_with_its_number_and_traceback():
    with pytest.raises(RankError) as info:
        spawn_world(raise_on_rank, 2, 1, deadline_s=60)
    assert info.value.rank == 1
    assert "rank 1 failed: ZeroDivisionError: bad arithmetic on purpose" in str(info.value)
    assert "raise_on_rank" in info.value.remote_traceback  # the failing rank's own frames


def test_a_copyable_functions_refusal_in_a_rank_is_bad_input_not_a_crash():
    """apply_fully_shard raises ShardingError (its module's ValueError, so that it copies alone):
    spawn_world reports it as RecipeError, one line, as it does RecipeError itself."""
    with pytest.raises(RecipeError) as info:
        spawn_world(refuse_a_model_on_rank, 2, 1, deadline_s=60)
    assert str(info.value) == (
        "rank 1: apply_fully_shard found no Conv2d in Linear; its module classes are: Linear"
    )


def test_a_skipped_collective_times_out_naming_rank_and_operation():
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn_world(skip_a_collective, 2, 3, deadline_s=60)
    assert (info.value.rank, info.value.operation) == (0, "all_reduce")
    assert "rank 0 failed in all_reduce" in str(info.value)
    assert time.monotonic() - started < 45, (
        "the collective timeout, not the world deadline, should end it"
    )


def test_a_stuck_world_is_killed_at_its_deadline_with_where_each_rank_waited():
    started = time.monotonic()
    with pytest.raises(WorldTimeoutError) as info:
        # 10 s: ranks start from the fork server in well under a second, so both are in their
        # barrier long before the deadline even on a loaded 2-core machine.
        spawn_world(wait_forever_in_barrier, 2, deadline_s=10)
    message = str(info.value).splitlines()[0]
    # the deadline the world got: 10 s times the run's factor (tests/deadlines.py)
    assert f"did not finish within {scaled(10):.0f}s" in message
    assert "rank 0 waiting in barrier called from wait_forever_in_barrier" in message
    assert "rank 1 waiting in no collective" in message
    # ended by the world's deadline, long before the collectives' 600 s (scaled like it: under
    # load the deadline itself is longer than 45 s)
    assert time.monotonic() - started < scaled(45)


def test_a_rank_that_dies_stops_the_world_and_is_named():
    with pytest.raises(
        RankError,
        match="rank 1 exited with code 3 without raising an error; the other ranks were stopped",
    ):
        spawn_world(die_mid_run, 2, deadline_s=60)


class LateExit:
    """A rank's process whose exit code the parent learns ``after_s`` seconds from now: what a
    fork server starved of CPU does when it passes on the code of a rank it has reaped."""

    def __init__(self, code, after_s):
        self.code, self.at = code, time.monotonic() + after_s

    @property
    def exitcode(self):
        return self.code if time.monotonic() >= self.at else None


def test_a_dead_rank_is_named_even_when_its_exit_code_comes_after_the_survivors_report(tmp_path):
    """Seen beside busy processes: rank 1 died mid-save (os._exit), rank 0 reported the broken
    connection at once, and rank 1's exit code reached the parent over 0.5 s later. The parent
    waits for every rank to exit or report (up to spawn.SETTLE_S) before it names the cause."""
    import pickle

    from recipes.core import spawn

    report = {"time": time.time(), "type": "RuntimeError", "message": "Connection reset by peer"}
    report |= {"traceback": "", "operation": "all_gather", "is_recipe_error": False}
    (tmp_path / "error0.pkl").write_bytes(pickle.dumps(report))
    ranks = [LateExit(1, after_s=0.0), LateExit(1, after_s=1.5)]
    with pytest.raises(RankError, match="^rank 1 exited with code 1 without raising an error"):
        spawn._supervise(ranks, str(tmp_path), deadline_s=30)


def test_a_busy_master_port_is_a_one_line_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RecipeError, match=rf"MASTER_PORT {port} is already in use"):
            spawn_world(describe_world, 2, master_port=port, deadline_s=30)


def test_a_bad_number_on_the_command_line_is_one_line_and_exit_2():
    # Once NaN losses and exit 0. (The recipe's own argparse check, one line, through the harness
    # runner that the failure tests use: recipes.core.prove.)
    proc = run_cli(
        [PYTHON, "-m", "recipes.core.prove", "grad_accumulation", "--lr", "inf"], timeout_s=60
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: lr must be a finite number > 0, got inf"]
    assert "Traceback" not in proc.stderr
