"""The world harness: three ways in, backend choice, and failures that become clear errors, never
hangs."""

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from recipes.core.config import RecipeError, TrainConfig, config_table, parse_config
from recipes.core.world import RankError, WorldTimeoutError, join_world, resolve_backend
from tests.deadlines import scaled
from tests.helpers import PYTHON, run_cli, spawn_world


# Module-level functions: spawned ranks import them by name.
def describe_world():
    with join_world("gloo", timeout_s=30) as world:
        ranks = [None] * world.world_size
        dist.all_gather_object(ranks, (world.rank, world.local_rank, world.launcher))
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
    assert ranks == [(0, 0, "spawn"), (1, 1, "spawn"), (2, 2, "spawn")]


def test_a_single_process_is_a_world_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    world_size, backend, device, ranks = describe_world()
    assert (world_size, backend, device, ranks) == (1, "gloo", "cpu", [(0, 0, "single")])
    assert not dist.is_initialized(), "the process group must be destroyed on the way out"


def test_process_group_is_destroyed_when_the_body_raises():
    with pytest.raises(KeyError):
        with join_world("gloo"):
            raise KeyError("boom")
    assert not dist.is_initialized()


def test_backend_choice_and_override(monkeypatch):
    gpus = torch.cuda.device_count()
    assert resolve_backend("auto", 1) == ("nccl" if gpus >= 1 else "gloo")
    assert resolve_backend("gloo", 1) == "gloo"
    monkeypatch.setenv("RECIPES_BACKEND", "gloo")
    assert resolve_backend("auto", 1) == "gloo", "the environment variable overrides auto"
    with pytest.raises(RecipeError, match="valid values: auto, gloo, nccl"):
        resolve_backend("mpi", 1)
    with pytest.raises(
        RecipeError, match=rf"needs one CUDA device per local rank: {gpus + 1} local rank"
    ):
        resolve_backend("nccl", gpus + 1)


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
    assert time.monotonic() - started < 45


def test_a_rank_that_dies_stops_the_world_and_is_named():
    with pytest.raises(
        RankError,
        match="rank 1 exited with code 3 without raising an error; the other ranks were stopped",
    ):
        spawn_world(die_mid_run, 2, deadline_s=60)


def test_a_busy_master_port_is_a_one_line_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RecipeError, match=rf"MASTER_PORT {port} is already in use"):
            spawn_world(describe_world, 2, master_port=port, deadline_s=30)


# --------------------------------------------------------------------------------------------------
# Config: every number declares its range next to its default (opt), one check enforces them all.


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"steps": 0}, r"^steps must be >= 1, got 0$"),
        ({"global_batch_size": -4}, r"^global_batch_size must be >= 1, got -4$"),
        ({"lr": -1.0}, r"^lr must be a finite number > 0, got -1$"),
        ({"lr": float("nan")}, r"^lr must be a finite number > 0, got nan$"),
        ({"lr": float("inf")}, r"^lr must be a finite number > 0, got inf$"),
        ({"timeout_s": 0.0}, r"^timeout_s must be a finite number > 0, got 0$"),
        ({"timeout_s": -5.0}, r"^timeout_s must be a finite number > 0, got -5$"),
        ({"seed": -1}, r"^seed must be >= 0, got -1$"),
        ({"steps": 2.5}, r"^steps must be a whole number >= 1, got 2.5$"),
        ({"lr": "fast"}, r"^lr must be a number > 0, got 'fast'$"),
    ],
)
def test_shared_fields_refuse_values_outside_their_range(changes, message):
    with pytest.raises(RecipeError, match=message):
        TrainConfig(**changes)


def _outside(bound_name: str, bound: float, kind: type, finite: bool = True) -> list:
    """Values just outside one declared bound (and nan, and inf for a finite float: a float field
    with finite=False takes inf, e.g. expert_parallel's --capacity-factor inf = no capacity)."""
    step = 1 if kind is int else 0.5
    edge = {"ge": bound - step, "gt": bound, "le": bound + step, "lt": bound}[bound_name]
    return [kind(edge)] + ([float("nan")] + [float("inf")] * finite if kind is float else [])


def test_every_numeric_option_of_every_recipe_declares_a_range_that_is_enforced(capsys):
    """Every recipe is copyable now: its command line is its own argparse parser, and each number
    goes through the recipe's ``_number(kind, above=... | at_least=...)`` type: each value just
    outside its declared bound, nan and inf must end in one usage line and exit 2. (The recipes
    that parse a number with a bare ``type=int`` or ``type=float`` check it in their own config or
    ``train`` instead, with their own messages: data, evaluation, job, memory_estimate, dry_run,
    finetune, profiling, preflight, comm_bench, loss_compare; tests/test_bad_input.py and each
    recipe's tests refuse their bad values. This test asserts the declared ranges.)"""
    import argparse
    import importlib

    from recipes.__main__ import recipe_modules

    checked = 0
    for name in recipe_modules():
        module = importlib.import_module(f"recipes.{name}")
        parser = module.make_parser()
        required = [a for a in parser._actions if a.required and a.option_strings == []]
        # a positional (loss_compare's result files) is given, so only the option is wrong
        base = ["x"] * sum(1 for a in required if a.nargs in (None, 1))
        for action in parser._actions:
            kind = action.type
            cells = dict(
                zip(
                    getattr(getattr(kind, "__code__", None), "co_freevars", ()),
                    getattr(kind, "__closure__", None) or (),
                )
            )
            if "kind" not in cells or not action.option_strings:
                continue  # not a number
            number = cells["kind"].cell_contents
            above = cells["above"].cell_contents if "above" in cells else None
            at_least = next(
                (cells[n].cell_contents for n in ("at_least", "least") if n in cells), None
            )
            bad = [above] if above is not None else [at_least - (1 if number is int else 0.5)]
            if number is float:
                bad += [float("nan"), float("inf")]
            for value in bad:
                with pytest.raises(SystemExit) as exit_info:
                    parser.parse_args(base + [action.option_strings[0], str(value)])
                assert exit_info.value.code == 2, (name, action.option_strings, value)
                err = capsys.readouterr().err
                assert " must be " in err or "expected a" in err, (name, err)
                checked += 1
            assert isinstance(parser, argparse.ArgumentParser)
    assert checked > 100, checked


def test_help_and_the_docs_option_tables_show_each_range(capsys):
    rows = {flag: help_text for flag, _, help_text in config_table(TrainConfig)}
    assert rows["--steps"] == "optimizer steps to run (>= 1)"
    assert rows["--lr"] == "AdamW learning rate (> 0, finite)"
    assert rows["--backend"].endswith("(env RECIPES_BACKEND)")  # not a number: no range
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--help"])
    assert "AdamW learning rate (> 0, finite) (default: 0.001)" in capsys.readouterr().out


def test_a_bad_number_on_the_command_line_is_one_line_and_exit_2():
    # Once NaN losses and exit 0. (The recipe's own argparse check, one line, through the harness
    # runner that the failure tests use: recipes.core.prove.)
    proc = run_cli(
        [PYTHON, "-m", "recipes.core.prove", "grad_accumulation", "--lr", "inf"], timeout_s=60
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: lr must be a finite number > 0, got inf"]
    assert "Traceback" not in proc.stderr
